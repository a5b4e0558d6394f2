"""Avro schemas (the .avsc files are the source of truth) and the single-object codec."""

from schemas.codec import Codec, Decoded, DecodeError

__all__ = ["Codec", "Decoded", "DecodeError"]
