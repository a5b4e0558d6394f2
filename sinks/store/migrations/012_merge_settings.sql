-- Fewer background merges. The sink inserts once a second per table while a backlog
-- drains, and merging those parts took the largest share of the sink's CPU (MergeMutate threads:
-- 4.35 s of about 12 s in a `rlpulse bench --quick` drain). ClickHouse's default merge selector
-- (base 5) rewrites each row a few more times than these tables need: with base 20 a merge waits
-- for about 20 parts of a size, so each row is rewritten fewer times (MergeMutate: 2.03 s in a
-- quick drain). Queries read a few more parts meanwhile (tens, far from the 1,000 at which
-- inserts are delayed). Table settings, so a server's tables get them too
-- (merge_selector_base exists since ClickHouse 24.11; compose runs 25.8).
ALTER TABLE {db}.spans MODIFY SETTING merge_selector_base = 20;
ALTER TABLE {db}.steps MODIFY SETTING merge_selector_base = 20;
ALTER TABLE {db}.gpu_samples MODIFY SETTING merge_selector_base = 20;
ALTER TABLE {db}.placements MODIFY SETTING merge_selector_base = 20;
ALTER TABLE {db}.grader_failures MODIFY SETTING merge_selector_base = 20;
ALTER TABLE {db}.alerts MODIFY SETTING merge_selector_base = 20;
ALTER TABLE {db}.step_stats MODIFY SETTING merge_selector_base = 20;
ALTER TABLE {db}.reward_histograms MODIFY SETTING merge_selector_base = 20;
ALTER TABLE {db}.completion_length_histograms MODIFY SETTING merge_selector_base = 20;
ALTER TABLE {db}.grader_windows MODIFY SETTING merge_selector_base = 20;
ALTER TABLE {db}.engine_samples MODIFY SETTING merge_selector_base = 20;
ALTER TABLE {db}.capacity MODIFY SETTING merge_selector_base = 20;
