"""Alert delivery: ``rlpulse alerts`` follows the alerts topic and posts each alert to a webhook."""
