# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Decodes the records of one Avro container block with a schema compiled to a small tree of ops.

fastavro's reader dispatches on the schema's JSON types for every field of every record; here
the schema is compiled once (``compile_schema``) into typed nodes, and fields the caller does not
want are skipped without building Python objects for them. Used only when the writer schema is
the reader schema (no resolution needed) and the block is uncompressed; ``schemas.codec`` falls
back to fastavro otherwise, and when this extension is not built.
"""

from libc.string cimport memcmp, memcpy

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
        n.children = [compile_schema(f["type"], None, named) for f in schema["fields"]]
    else:
        raise ValueError(f"cannot compile Avro type {t!r}")
    return n


cdef inline long long read_long(const unsigned char[:] buf, Py_ssize_t* pos) except? -1:
    cdef unsigned long long result = 0
    cdef int shift = 0
    cdef unsigned char b
    cdef Py_ssize_t p = pos[0]
    cdef Py_ssize_t end = buf.shape[0]
    while True:
        if p >= end:
            raise BlockDecodeError("truncated Avro data (varint)")
        b = buf[p]
        p += 1
        result |= (<unsigned long long>(b & 0x7F)) << shift
        if not (b & 0x80):
            break
        shift += 7
        if shift > 63:
            raise BlockDecodeError("corrupt Avro data (varint longer than 10 bytes)")
    pos[0] = p
    return <long long>((result >> 1) ^ (-(result & 1)))


cdef inline Py_ssize_t take(const unsigned char[:] buf, Py_ssize_t* pos, Py_ssize_t n) except -1:
    cdef Py_ssize_t p = pos[0]
    # n - not p + n: a length near 2**63 from a corrupt varint would overflow the sum past the
    # check, and the reads after it would run outside the buffer (a segfault of the worker)
    if n < 0 or n > buf.shape[0] - p:
        raise BlockDecodeError("truncated Avro data")
    pos[0] = p + n
    return p


cdef object read(Node n, const unsigned char[:] buf, Py_ssize_t* pos):
    cdef Py_ssize_t p, length, i
    cdef long long count
    cdef double d
    cdef float f
    cdef Node child
    cdef dict out
    cdef list items
    cdef int op = n.op
    if op == OP_LONG or op == OP_INT:
        return read_long(buf, pos)
    if op == OP_STRING:
        length = read_long(buf, pos)
        p = take(buf, pos, length)
        if length == 0:
            return ""
        if length > LAST:
            return (<const char*>&buf[0])[p:p + length].decode("utf-8")
        if length == n.last_len and memcmp(n.last_raw, &buf[p], length) == 0:
            return n.last_str
        text = (<const char*>&buf[0])[p:p + length].decode("utf-8")  # raises for bad UTF-8: nothing kept
        memcpy(n.last_raw, &buf[p], length)
        n.last_len = length
        n.last_str = text
        return text
    if op == OP_UNION:
        i = read_long(buf, pos)
        if i < 0 or i >= len(n.children):
            raise BlockDecodeError("union branch out of range")
        return read(<Node>n.children[i], buf, pos)
    if op == OP_NULL:
        return None
    if op == OP_DOUBLE:
        p = take(buf, pos, 8)
        memcpy(&d, &buf[p], 8)
        return d
    if op == OP_BOOL:
        p = take(buf, pos, 1)
        return buf[p] != 0
    if op == OP_ENUM:
        i = read_long(buf, pos)
        if i < 0 or i >= len(n.symbols):
            raise BlockDecodeError("enum index out of range")
        return n.symbols[i]
    if op == OP_BYTES:
        length = read_long(buf, pos)
        p = take(buf, pos, length)
        return (<const char*>&buf[0])[p:p + length] if length else b""
    if op == OP_RECORD:
        out = {}
        for i in range(len(n.children)):
            if n.keep[i]:
                out[n.names[i]] = read(<Node>n.children[i], buf, pos)
            else:
                skip(<Node>n.children[i], buf, pos)
        return out
    if op == OP_MAP:
        out = {}
        child = <Node>n.children[0]
        while True:
            count = read_long(buf, pos)
            if count == 0:
                return out
            if count < 0:
                count = -count
                read_long(buf, pos)
            for i in range(count):
                length = read_long(buf, pos)
                p = take(buf, pos, length)
                key = (<const char*>&buf[0])[p:p + length].decode("utf-8")
                out[key] = read(child, buf, pos)
    if op == OP_ARRAY:
        items = []
        child = <Node>n.children[0]
        while True:
            count = read_long(buf, pos)
            if count == 0:
                return items
            if count < 0:
                count = -count
                read_long(buf, pos)
            for i in range(count):
                items.append(read(child, buf, pos))
    if op == OP_FLOAT:
        p = take(buf, pos, 4)
        memcpy(&f, &buf[p], 4)
        return f
    if op == OP_FIXED:
        p = take(buf, pos, n.size)
        return (<const char*>&buf[0])[p:p + n.size]
    raise BlockDecodeError("unknown op")


cdef int skip(Node n, const unsigned char[:] buf, Py_ssize_t* pos) except -1:
    cdef Py_ssize_t i, length
    cdef long long count
    cdef int op = n.op
    if op == OP_LONG or op == OP_INT or op == OP_ENUM:
        read_long(buf, pos)
    elif op == OP_STRING or op == OP_BYTES:
        length = read_long(buf, pos)
        take(buf, pos, length)
    elif op == OP_UNION:
        i = read_long(buf, pos)
        if i < 0 or i >= len(n.children):
            raise BlockDecodeError("union branch out of range")
        skip(<Node>n.children[i], buf, pos)
    elif op == OP_DOUBLE:
        take(buf, pos, 8)
    elif op == OP_BOOL:
        take(buf, pos, 1)
    elif op == OP_FLOAT:
        take(buf, pos, 4)
    elif op == OP_FIXED:
        take(buf, pos, n.size)
    elif op == OP_RECORD:
        for i in range(len(n.children)):
            skip(<Node>n.children[i], buf, pos)
    elif op == OP_MAP or op == OP_ARRAY:
        while True:
            count = read_long(buf, pos)
            if count == 0:
                break
            if count < 0:
                length = read_long(buf, pos)  # the block's byte size: skip it whole
                take(buf, pos, length)
                continue
            for i in range(count):
                if op == OP_MAP:
                    length = read_long(buf, pos)
                    take(buf, pos, length)
                skip(<Node>n.children[0], buf, pos)
    return 0


def decode_block(Node node, const unsigned char[:] block, long long count):
    """``count`` records of ``node`` from one block's bytes; the block must be consumed exactly."""
    cdef Py_ssize_t pos = 0
    cdef long long i
    out = []
    for i in range(count):
        out.append(read(node, block, &pos))
    # Bytes after the block's stated records are ignored, as fastavro (the streams' other path),
    # ClickHouse (the sink's insert) and Java's reader do: refusing them here alone made the streams
    # skip a message whose rows the sink had inserted (found by test_garbage_writer).
    return out
