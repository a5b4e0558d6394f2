# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Decodes the records of one Avro container block with a schema compiled to a small tree of ops.

fastavro's reader dispatches on the schema's JSON types for every field of every record; here
the schema is compiled once (``compile_schema``) into typed nodes, and fields the caller does not
want are skipped without building Python objects for them. Used only when the writer schema is
the reader schema (no resolution needed) and the block is uncompressed; ``schemas.codec`` falls
back to fastavro otherwise, and when this extension is not built.
"""

from libc.string cimport memcmp, memcpy

cdef extern from "Python.h":
    # A dict with room for a record's fields from the start: built up from empty, a 24-field
    # record's dict was resized three times (CPython's own ``dict(**kw)`` presizes the same way).
    dict _PyDict_NewPresized(Py_ssize_t minused)

include "_avroops.pxi"  # the OP_* codes, shared with the other block module


class BlockDecodeError(ValueError):
    pass


DEF LAST = 64  # a string field's value up to this many bytes is kept to be compared with the next


cdef class Node:
    cdef public int op
    cdef public tuple symbols
    cdef public list children
    cdef public list names
    cdef public list keep
    cdef public int size
    cdef public Py_ssize_t kept  # a record's fields that are built (``keep``)
    # A string field's last value, its bytes and its str: the next record's same bytes get the same
    # str, not a new one (a container's records of one run repeat project, run_id, writer_id, term,
    # outcome ... record after record). Each field has its own node (compile_schema makes one per
    # occurrence), so the comparison is with the same field of the record before.
    cdef object last_str
    cdef Py_ssize_t last_len
    cdef unsigned char last_raw[LAST]


_PRIMITIVE = {"null": OP_NULL, "boolean": OP_BOOL, "int": OP_INT, "long": OP_LONG, "float": OP_FLOAT,
              "double": OP_DOUBLE, "string": OP_STRING, "bytes": OP_BYTES}


def compile_schema(schema, fields=None, named=None):
    """A Node tree for a fastavro-parsed ``schema``; ``fields`` (top-level names) limits what is built."""
    if named is None:
        named = {}
    cdef Node n = Node()
    if isinstance(schema, str):
        if schema in _PRIMITIVE:
            n.op = _PRIMITIVE[schema]
            return n
        return named[schema]
    if isinstance(schema, list):
        n.op = OP_UNION
        n.children = [compile_schema(s, None, named) for s in schema]
        return n
    t = schema["type"]
    if t in _PRIMITIVE and "logicalType" not in schema:
        n.op = _PRIMITIVE[t]
        return n
    if t == "enum":
        n.op = OP_ENUM
        n.symbols = tuple(schema["symbols"])
        named[schema["name"]] = n
    elif t == "fixed":
        n.op = OP_FIXED
        n.size = schema["size"]
        named[schema["name"]] = n
    elif t == "map":
        n.op = OP_MAP
        n.children = [compile_schema(schema["values"], None, named)]
    elif t == "array":
        n.op = OP_ARRAY
        n.children = [compile_schema(schema["items"], None, named)]
    elif t == "record":
        n.op = OP_RECORD
        named[schema["name"]] = n
        n.names = [f["name"] for f in schema["fields"]]
        n.keep = [fields is None or f["name"] in fields for f in schema["fields"]]
        n.kept = sum(n.keep)
        n.children = [compile_schema(f["type"], None, named) for f in schema["fields"]]
    else:
        raise ValueError(f"cannot compile Avro type {t!r}")
    return n


cdef struct Buf:
    # The block being read: a pointer and its end, passed by address. A memoryview slice passed to
    # every cdef call costs an acquisition count (an atomic increment and decrement) per field;
    # this is the same bytes, each read still checked against ``end``.
    const unsigned char* data
    Py_ssize_t pos
    Py_ssize_t end


cdef inline long long read_long(Buf* b) except? -1:
    cdef unsigned long long result = 0
    cdef int shift = 0
    cdef unsigned char c
    cdef Py_ssize_t p = b.pos
    cdef Py_ssize_t end = b.end
    while True:
        if p >= end:
            raise BlockDecodeError("truncated Avro data (varint)")
        c = b.data[p]
        p += 1
        result |= (<unsigned long long>(c & 0x7F)) << shift
        if not (c & 0x80):
            break
        shift += 7
        if shift > 63:
            raise BlockDecodeError("corrupt Avro data (varint longer than 10 bytes)")
    b.pos = p
    return <long long>((result >> 1) ^ (-(result & 1)))


cdef inline Py_ssize_t take(Buf* b, Py_ssize_t n) except -1:
    cdef Py_ssize_t p = b.pos
    # n - not p + n: a length near 2**63 from a corrupt varint would overflow the sum past the
    # check, and the reads after it would run outside the buffer (a segfault of the worker)
    if n < 0 or n > b.end - p:
        raise BlockDecodeError("truncated Avro data")
    b.pos = p + n
    return p


cdef object read(Node n, Buf* b):
    cdef Py_ssize_t p, length, i
    cdef long long count
    cdef double d
    cdef float f
    cdef Node child
    cdef dict out
    cdef list items, names, keep, children
    cdef Py_ssize_t kept
    cdef int op = n.op
    if op == OP_LONG or op == OP_INT:
        return read_long(b)
    if op == OP_STRING:
        length = read_long(b)
        p = take(b, length)
        if length == 0:
            return ""
        if length > LAST:
            return (<const char*>b.data)[p:p + length].decode("utf-8")
        if length == n.last_len and memcmp(n.last_raw, b.data + p, length) == 0:
            return n.last_str
        text = (<const char*>b.data)[p:p + length].decode("utf-8")  # raises for bad UTF-8: nothing kept
        memcpy(n.last_raw, b.data + p, length)
        n.last_len = length
        n.last_str = text
        return text
    if op == OP_UNION:
        i = read_long(b)
        if i < 0 or i >= len(n.children):
            raise BlockDecodeError("union branch out of range")
        return read(<Node>n.children[i], b)
    if op == OP_NULL:
        return None
    if op == OP_DOUBLE:
        p = take(b, 8)
        memcpy(&d, b.data + p, 8)
        return d
    if op == OP_BOOL:
        p = take(b, 1)
        return b.data[p] != 0
    if op == OP_ENUM:
        i = read_long(b)
        if i < 0 or i >= len(n.symbols):
            raise BlockDecodeError("enum index out of range")
        return n.symbols[i]
    if op == OP_BYTES:
        length = read_long(b)
        p = take(b, length)
        return (<const char*>b.data)[p:p + length] if length else b""
    if op == OP_RECORD:
        names, keep, children, kept = n.names, n.keep, n.children, n.kept
        out = _PyDict_NewPresized(kept)
        for i in range(len(children)):
            if keep[i]:
                out[names[i]] = read(<Node>children[i], b)
            else:
                skip(<Node>children[i], b)
        return out
    if op == OP_MAP:
        out = {}
        child = <Node>n.children[0]
        while True:
            count = read_long(b)
            if count == 0:
                return out
            if count < 0:
                count = -count
                read_long(b)
            for i in range(count):
                length = read_long(b)
                p = take(b, length)
                key = (<const char*>b.data)[p:p + length].decode("utf-8")
                out[key] = read(child, b)
    if op == OP_ARRAY:
        items = []
        child = <Node>n.children[0]
        while True:
            count = read_long(b)
            if count == 0:
                return items
            if count < 0:
                count = -count
                read_long(b)
            for i in range(count):
                items.append(read(child, b))
    if op == OP_FLOAT:
        p = take(b, 4)
        memcpy(&f, b.data + p, 4)
        return f
    if op == OP_FIXED:
        p = take(b, n.size)
        return (<const char*>b.data)[p:p + n.size]
    raise BlockDecodeError("unknown op")


cdef int skip(Node n, Buf* b) except -1:
    cdef Py_ssize_t i, length
    cdef long long count
    cdef int op = n.op
    if op == OP_LONG or op == OP_INT or op == OP_ENUM:
        read_long(b)
    elif op == OP_STRING or op == OP_BYTES:
        length = read_long(b)
        take(b, length)
    elif op == OP_UNION:
        i = read_long(b)
        if i < 0 or i >= len(n.children):
            raise BlockDecodeError("union branch out of range")
        skip(<Node>n.children[i], b)
    elif op == OP_DOUBLE:
        take(b, 8)
    elif op == OP_BOOL:
        take(b, 1)
    elif op == OP_FLOAT:
        take(b, 4)
    elif op == OP_FIXED:
        take(b, n.size)
    elif op == OP_RECORD:
        for i in range(len(n.children)):
            skip(<Node>n.children[i], b)
    elif op == OP_MAP or op == OP_ARRAY:
        while True:
            count = read_long(b)
            if count == 0:
                break
            if count < 0:
                length = read_long(b)  # the block's byte size: skip it whole
                take(b, length)
                continue
            for i in range(count):
                if op == OP_MAP:
                    length = read_long(b)
                    take(b, length)
                skip(<Node>n.children[0], b)
    return 0


def decode_block(Node node, const unsigned char[:] block, long long count):
    """``count`` records of ``node`` from one block's bytes; the block must be consumed exactly."""
    cdef Buf b
    cdef long long i
    cdef unsigned char empty = 0
    b.pos = 0
    b.end = block.shape[0]
    b.data = &block[0] if b.end > 0 else &empty  # ``block`` holds its buffer for the whole call
    out = []
    for i in range(count):
        out.append(read(node, &b))
    # Bytes after the block's stated records are ignored, as fastavro (the streams' other path),
    # ClickHouse (the sink's insert) and Java's reader do: refusing them here alone made the streams
    # skip a message whose rows the sink had inserted (found by test_garbage_writer).
    return out
