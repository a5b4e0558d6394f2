# The Avro type codes of the compiled block decoder and encoder (schemas/_blockdecode.pyx,
# schemas/_blockencode.pyx): one list, so a node means the same to both.
cdef enum:
    OP_NULL = 0
    OP_BOOL = 1
    OP_INT = 2
    OP_LONG = 3
    OP_FLOAT = 4
    OP_DOUBLE = 5
    OP_STRING = 6
    OP_BYTES = 7
    OP_ENUM = 8
    OP_UNION = 9
    OP_MAP = 10
    OP_ARRAY = 11
    OP_RECORD = 12
    OP_FIXED = 13
