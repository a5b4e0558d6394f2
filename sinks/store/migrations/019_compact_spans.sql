-- The spans table's parts in ClickHouse's compact format up to 128 MiB (uncompressed), wide above.
-- ClickHouse writes a part of over 10 MiB (its default min_bytes_for_wide_part) as two or three
-- files per column, some 80 files for a span part, and merges rewrite them all again: in a drain of
-- 600,000 spans through the sink alone its inserts and merges made 5 wide parts at 5.5-5.7 us of
-- sink CPU a span; compact, one data file per part, 4.3-4.7 us (python -m bench.sink). A backlog's
-- inserts (100,000 rows, about 40 MiB) stay compact; the large parts merges make later are wide,
-- which is where reading few columns of many rows gains from it. A table setting, so a server's
-- table gets it too.
ALTER TABLE {db}.spans MODIFY SETTING min_bytes_for_wide_part = 134217728;
