"""The ground: Avro schemas (the .avsc files are the source of truth), the container codec, the
catalogue of names, settings and file helpers. Imports nothing else of rlpulse."""

from rlpulse.schemas.codec import Codec, Decoded, DecodeError

__all__ = ["Codec", "Decoded", "DecodeError"]
