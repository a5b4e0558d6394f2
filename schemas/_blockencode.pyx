# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Encodes records into the body of one Avro container block, with a schema compiled to typed nodes.

fastavro's writer picks each union branch by running its validators over the branches, field
by field: about 12 µs for one Span. Here the schema is compiled once (``compile_encoder``) and
each field is written by its node. Only well-formed records take this path: anything it does
not handle exactly as fastavro does (a missing field without a default, an extra field, a value
of another type, a union holding a record) raises :class:`Unencodable`, and ``schemas.codec``
encodes the whole container with fastavro instead, so its bytes and its errors are fastavro's.
``tests/unit/schemas/test_codec_encoder.py`` compares the two byte for byte.
"""

import sys

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.dict cimport PyDict_GetItem
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyObject
from cpython.unicode cimport PyUnicode_AsUTF8AndSize
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcpy

include "_avroops.pxi"  # the OP_* codes, shared with the other block module


class Unencodable(ValueError):
    """This record is not for the fast path: encode the container with fastavro."""


cdef class ENode:
    cdef public int op
    cdef public dict symbols  # enum: symbol -> index
    cdef public list children
    cdef public list names
    cdef public list has_default
    cdef public list defaults
    cdef public int size


_PRIMITIVE = {"null": OP_NULL, "boolean": OP_BOOL, "int": OP_INT, "long": OP_LONG, "float": OP_FLOAT,
              "double": OP_DOUBLE, "string": OP_STRING, "bytes": OP_BYTES}
_UNION_BRANCHES = (OP_NULL, OP_BOOL, OP_INT, OP_LONG, OP_DOUBLE, OP_STRING, OP_BYTES, OP_ENUM, OP_FIXED)


def compile_encoder(schema, named=None):
    """An ENode tree for a fastavro-parsed ``schema``; ValueError for what this encoder leaves to fastavro."""
    if named is None:
        if sys.byteorder != "little":  # doubles are copied as the machine holds them; Avro's are little-endian
            raise ValueError("big-endian machine: left to fastavro")
        named = {}
    cdef ENode n = ENode()
    if isinstance(schema, str):
        if schema in _PRIMITIVE:
            n.op = _PRIMITIVE[schema]
            return n
        return named[schema]
    if isinstance(schema, list):
        n.op = OP_UNION
        n.children = [compile_encoder(s, named) for s in schema]
        # fastavro prefers a later double to an earlier float, and the record with the most
        # matching fields: neither rule is needed by these schemas, so such unions stay with it
        if any((<ENode>c).op not in _UNION_BRANCHES for c in n.children):
            raise ValueError("union branch left to fastavro")
        return n
    t = schema["type"]
    if "logicalType" in schema:
        raise ValueError("logical types are left to fastavro")
    if t in _PRIMITIVE:
        n.op = _PRIMITIVE[t]
        return n
    if t == "enum":
        n.op = OP_ENUM
        n.symbols = {s: i for i, s in enumerate(schema["symbols"])}
        named[schema["name"]] = n
    elif t == "fixed":
        n.op = OP_FIXED
        n.size = schema["size"]
        named[schema["name"]] = n
    elif t == "map":
        n.op = OP_MAP
        n.children = [compile_encoder(schema["values"], named)]
    elif t == "array":
        n.op = OP_ARRAY
        n.children = [compile_encoder(schema["items"], named)]
    elif t == "record":
        n.op = OP_RECORD
        named[schema["name"]] = n
        n.names = [f["name"] for f in schema["fields"]]
        n.has_default = ["default" in f for f in schema["fields"]]
        n.defaults = [f.get("default") for f in schema["fields"]]
        n.children = [compile_encoder(f["type"], named) for f in schema["fields"]]
    else:
        raise ValueError(f"cannot compile Avro type {t!r}")
    return n


cdef class Buf:
    cdef char* data
    cdef Py_ssize_t length
    cdef Py_ssize_t capacity

    def __cinit__(self):
        self.capacity = 4096
        self.length = 0
        self.data = <char*>PyMem_Malloc(self.capacity)
        if self.data == NULL:
            raise MemoryError()

    def __dealloc__(self):
        PyMem_Free(self.data)

    cdef int reserve(self, Py_ssize_t n) except -1:
        cdef Py_ssize_t want = self.length + n
        cdef char* grown
        if want <= self.capacity:
            return 0
        while self.capacity < want:
            self.capacity *= 2
        grown = <char*>PyMem_Realloc(self.data, self.capacity)
        if grown == NULL:
            raise MemoryError()
        self.data = grown
        return 0

    cdef int put(self, const char* p, Py_ssize_t n) except -1:
        self.reserve(n)
        memcpy(self.data + self.length, p, n)
        self.length += n
        return 0

    cdef int put_long(self, int64_t v) except -1:
        cdef uint64_t z = (<uint64_t>v << 1) ^ <uint64_t>(v >> 63)
        self.reserve(10)
        while z >= 0x80:
            self.data[self.length] = <char>((z & 0x7F) | 0x80)
            self.length += 1
            z >>= 7
        self.data[self.length] = <char>z
        self.length += 1
        return 0


cdef inline bint is_integer(object datum):
    return isinstance(datum, int) and not isinstance(datum, bool)


cdef bint matches(ENode n, object datum) except -1:
    """fastavro's validator for one union branch (only the branch kinds compile_encoder allows)."""
    cdef int op = n.op
    if op == OP_NULL:
        return datum is None
    if op == OP_STRING:
        return isinstance(datum, str)
    if op == OP_LONG:
        return is_integer(datum) and -9223372036854775808 <= datum <= 9223372036854775807
    if op == OP_INT:
        return is_integer(datum) and -2147483648 <= datum <= 2147483647
    if op == OP_DOUBLE:
        return (isinstance(datum, float) or isinstance(datum, int)) and not isinstance(datum, bool)
    if op == OP_BOOL:
        return isinstance(datum, bool)
    if op == OP_BYTES:
        return isinstance(datum, (bytes, bytearray))
    if op == OP_ENUM:
        return isinstance(datum, str) and datum in n.symbols
    if op == OP_FIXED:  # fastavro's compiled validator takes a bytearray too
        return isinstance(datum, (bytes, bytearray)) and len(datum) == n.size
    raise Unencodable("union branch")


cdef int write_text(Buf b, object datum) except -1:
    cdef Py_ssize_t size
    cdef const char* p
    if not isinstance(datum, str):
        raise Unencodable("not a string")
    p = PyUnicode_AsUTF8AndSize(datum, &size)
    b.put_long(size)
    b.put(p, size)
    return 0


cdef int write(ENode n, object datum, Buf b) except -1:
    cdef int op = n.op
    cdef Py_ssize_t i, count, found
    cdef double d
    cdef float f
    cdef int64_t v
    cdef bytes raw
    cdef PyObject* item
    cdef ENode child
    if op == OP_STRING:
        return write_text(b, datum)
    if op == OP_UNION:
        for i in range(len(n.children)):
            child = <ENode>n.children[i]
            if matches(child, datum):
                b.put_long(i)
                return write(child, datum, b)
        raise Unencodable("no union branch")
    if op == OP_LONG or op == OP_INT:
        if not is_integer(datum):
            raise Unencodable("not an integer")
        if op == OP_INT and not -2147483648 <= datum <= 2147483647:
            raise Unencodable("int out of range")
        v = datum  # OverflowError past 64 bits: fastavro's path says so
        return b.put_long(v)
    if op == OP_NULL:
        if datum is not None:
            raise Unencodable("not null")
        return 0
    if op == OP_DOUBLE:
        if not (isinstance(datum, float) or is_integer(datum)):
            raise Unencodable("not a number")
        d = datum
        return b.put(<const char*>&d, 8)
    if op == OP_BOOL:
        if not isinstance(datum, bool):
            raise Unencodable("not a boolean")
        return b.put(b"\x01" if datum else b"\x00", 1)
    if op == OP_ENUM:
        if not isinstance(datum, str) or datum not in n.symbols:
            raise Unencodable("not a symbol")
        return b.put_long(n.symbols[datum])
    if op == OP_RECORD:
        if not isinstance(datum, dict):
            raise Unencodable("not a dict")
        found = 0
        for i in range(len(n.children)):
            item = PyDict_GetItem(datum, n.names[i])
            if item != NULL:
                found += 1
                write(<ENode>n.children[i], <object>item, b)
            elif n.has_default[i]:
                write(<ENode>n.children[i], n.defaults[i], b)
            else:
                raise Unencodable("missing field")
        if found != len(datum):
            raise Unencodable("extra fields")
        return 0
    if op == OP_MAP:
        if not isinstance(datum, dict):
            raise Unencodable("not a dict")
        count = len(datum)
        if count:
            b.put_long(count)
            child = <ENode>n.children[0]
            for key, value in (<dict>datum).items():
                write_text(b, key)
                write(child, value, b)
        return b.put_long(0)
    if op == OP_ARRAY:
        if not isinstance(datum, (list, tuple)):
            raise Unencodable("not a list")
        count = len(datum)
        if count:
            b.put_long(count)
            child = <ENode>n.children[0]
            for value in datum:
                write(child, value, b)
        return b.put_long(0)
    if op == OP_BYTES:
        if not isinstance(datum, (bytes, bytearray)):
            raise Unencodable("not bytes")
        raw = bytes(datum)
        b.put_long(len(raw))
        return b.put(<const char*>raw, len(raw))
    if op == OP_FIXED:
        if not isinstance(datum, (bytes, bytearray)) or len(datum) != n.size:
            raise Unencodable("not fixed bytes of the size")
        raw = bytes(datum)
        return b.put(<const char*>raw, n.size)
    if op == OP_FLOAT:
        if not (isinstance(datum, float) or is_integer(datum)):
            raise Unencodable("not a number")
        f = <float>(<double>datum)
        return b.put(<const char*>&f, 4)
    raise Unencodable("unknown op")


def encode_records(ENode node, list records):
    """The Avro binary encoding of ``records`` one after another: a container block's body."""
    cdef Buf b = Buf()
    for record in records:
        write(node, record, b)
    return PyBytes_FromStringAndSize(b.data, b.length)
