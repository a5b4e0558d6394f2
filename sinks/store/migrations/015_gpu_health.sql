-- GPU health (seed 001 "GPU health", issue 30): every throttle-reason bit by name, the XID's
-- class, memory from NVML v2 (reserved apart), and DCGM's defaults where NVML has them: the
-- energy counter, NVLink throughput, row remapping, tensor-pipe and DRAM activity (GPM). Each new
-- figure is NULL where the GPU or driver does not report it (and on rows written before this).
ALTER TABLE {db}.gpu_samples
    ADD COLUMN IF NOT EXISTS throttle_reason_names Array(String) DEFAULT [] AFTER xid_last,
    ADD COLUMN IF NOT EXISTS xid_class LowCardinality(Nullable(String)) AFTER throttle_reason_names,
    ADD COLUMN IF NOT EXISTS memory_reserved_bytes Nullable(UInt64) AFTER xid_class,
    ADD COLUMN IF NOT EXISTS energy_mj Nullable(UInt64) AFTER memory_reserved_bytes,
    ADD COLUMN IF NOT EXISTS nvlink_tx_bytes_per_s Nullable(Float64) AFTER energy_mj,
    ADD COLUMN IF NOT EXISTS nvlink_rx_bytes_per_s Nullable(Float64) AFTER nvlink_tx_bytes_per_s,
    ADD COLUMN IF NOT EXISTS remapped_rows_correctable Nullable(UInt32) AFTER nvlink_rx_bytes_per_s,
    ADD COLUMN IF NOT EXISTS remapped_rows_uncorrectable Nullable(UInt32) AFTER remapped_rows_correctable,
    ADD COLUMN IF NOT EXISTS remap_pending Nullable(Bool) AFTER remapped_rows_uncorrectable,
    ADD COLUMN IF NOT EXISTS remap_failure Nullable(Bool) AFTER remap_pending,
    ADD COLUMN IF NOT EXISTS tensor_activity Nullable(Float64) AFTER remap_failure,
    ADD COLUMN IF NOT EXISTS dram_activity Nullable(Float64) AFTER tensor_activity;
