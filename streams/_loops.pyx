# cython: language_level=3
"""The streams' innermost loops, compiled: a message's rollouts into their step's figures, and
values into the reward and exponential histograms.

Each function here is the Python method it is named after (``StepFigures.add_many``,
``RewardHistogram.add_many``, ``ExpHistogram.add_many``, ``GraderWindow.add_many``), line for
line, with C doubles for the float sums: the same additions in the same order give the same
bits, every figure and every error is the method's own (``tests/unit/streams/test_loops.py``
runs both on the same inputs and compares the states exactly). The methods call these where the
extension is built (setup.py, optional like the Avro block decoder) and run their own Python
otherwise. A change to one must be made to the other: the test says when they disagree.
"""

from libc.math cimport ceil, frexp, ldexp, log
from math import ceil as math_ceil

cdef double INF = float("inf")


# -- StepFigures.add_many ---------------------------------------------------------------------

def step_add_many(f, list spans, reward_histogram, Py_ssize_t max_terms, Py_ssize_t max_name,
                  Py_ssize_t max_samples):
    """``StepFigures.add_many(spans)`` for ``f`` (``reward_histogram``: the RewardHistogram class)."""
    cdef dict span, hist, shares_of, samples
    cdef list rewards, lengths, values, group
    cdef double reward, total, squares
    cdef Py_ssize_t clipped = 0
    f._body = None
    hist = f.hist
    if "total" not in hist:
        hist["total"] = reward_histogram()
    rewards = []
    shares_of = {"total": rewards}
    lengths = []
    last_ns, total, squares = f.last_ns, f.reward_sum, f.reward_sumsq
    lo, hi, tokens_sum = f.completion_min, f.completion_max, f.completion_sum
    samples = f.samples
    for span in spans:
        t = span["time_ns"]
        if t > last_ns:
            last_ns = t
        reward = float(span["reward"])
        if span.get("clipped"):
            clipped += 1
        total += reward
        squares += reward * reward
        rewards.append(reward)
        shares = span.get("term_shares")
        if shares:
            for term, share in shares.items():
                found = shares_of.get(term)
                if found is None:
                    if term not in hist:
                        if len(hist) > max_terms or len(term) > max_name:
                            f.terms_dropped += 1
                            continue
                        hist[term] = reward_histogram()
                    found = shares_of[term] = []
                (<list>found).append(float(share))
        tokens = span.get("completion_tokens")
        if tokens is not None:
            tokens_sum += tokens
            if lo is None or tokens < lo:
                lo = tokens
            if hi is None or tokens > hi:
                hi = tokens
            lengths.append(tokens)
        version = span.get("policy_version")
        if version is not None:
            stale = span["step"] - version
            f.stale_n += 1
            f.stale_sum += stale
            if f.stale_max is None or stale > f.stale_max:
                f.stale_max = stale
        sample = span.get("sample_id")
        if sample is not None:
            found = samples.get(sample)
            if found is None:
                if len(samples) >= max_samples or len(sample) > max_name:
                    f.samples_dropped += 1
                else:
                    samples[sample] = [1, reward, reward, reward, reward * reward]
            else:
                group = <list>found
                group[0] += 1
                if reward < group[1]:
                    group[1] = reward
                if reward > group[2]:
                    group[2] = reward
                group[3] += reward
                group[4] += reward * reward
    f.last_ns, f.rollouts, f.clipped = last_ns, f.rollouts + len(spans), f.clipped + clipped
    f.reward_sum, f.reward_sumsq = total, squares
    f.completions += len(lengths)
    f.completion_sum, f.completion_min, f.completion_max = tokens_sum, lo, hi
    for term, values in shares_of.items():
        hist[term].add_many(values)
    if lengths:
        f.lengths.add_many(lengths)
    if f.closed:
        f.dirty = True


# -- RewardHistogram.add_many -----------------------------------------------------------------

def reward_add_many(h, list xs, tuple bounds, reward_bucket):
    """``RewardHistogram.add_many(xs)`` for ``h`` (``bounds``: REWARD_BOUNDS; ``reward_bucket``
    raises naming a value that is not finite)."""
    cdef double b[32]
    cdef Py_ssize_t nb = len(bounds), i, lo_i, hi_i, mid, zeros
    cdef double x, s = 0.0, total, sq, lo_d = 0.0, hi_d = 0.0
    cdef bint has_lo, has_hi
    cdef list counts
    if nb > 32:
        raise ValueError("at most 32 reward bounds")
    for i in range(nb):
        b[i] = bounds[i]
    for x in xs:  # sum(xs) as Python adds it, for the same verdict on NaN and the infinities
        s += x
    if not -INF < s < INF:
        for x in xs:
            reward_bucket(x)
    counts = h.counts
    total, sq, zeros = h.sum, h.sumsq, h.zeros
    has_lo, has_hi = h.min is not None, h.max is not None
    if has_lo:
        lo_d = h.min
    if has_hi:
        hi_d = h.max
    for x in xs:
        lo_i, hi_i = 0, nb  # bisect_left: the first bound x is at or below
        while lo_i < hi_i:
            mid = (lo_i + hi_i) // 2
            if b[mid] < x:
                lo_i = mid + 1
            else:
                hi_i = mid
        counts[lo_i] += 1
        total += x
        sq += x * x
        if not has_lo or x < lo_d:
            lo_d, has_lo = x, True
        if not has_hi or x > hi_d:
            hi_d, has_hi = x, True
        if lo_i == 0:
            zeros += 1
    h.count += len(xs)
    h.sum, h.sumsq, h.zeros = total, sq, zeros
    h.min = lo_d if has_lo else None
    h.max = hi_d if has_hi else None


# -- ExpHistogram.add_many --------------------------------------------------------------------

cdef long long exp_index_c(double value, int scale):
    """``histograms.exp_index``: the same frexp, log and clamps, so the same bucket."""
    cdef int exp
    cdef double mantissa = frexp(value, &exp)
    cdef long long ieee_exp = exp - 1, index
    cdef long long step
    # Python's << and >> on negative numbers: a multiplication (C leaves << of a negative number
    # undefined) and gcc's arithmetic shift (a floor, as Python's)
    if mantissa == 0.5:
        return ieee_exp * (1LL << scale) - 1 if scale >= 0 else (ieee_exp - 1) >> -scale
    if scale <= 0:
        return ieee_exp >> -scale
    step = 1LL << scale
    index = <long long>ceil(log(value) * (ldexp(1.0, scale) / log(2.0))) - 1
    if index < ieee_exp * step:
        index = ieee_exp * step
    if index > (ieee_exp + 1) * step - 1:
        index = (ieee_exp + 1) * step - 1
    return index


def exp_index(double value, int scale):
    """``histograms.exp_index`` (for the test that compares the two)."""
    return exp_index_c(value, scale)


def exp_add_many(h, values, cached_index, downscale_needed):
    """``ExpHistogram.add_many(values)`` for ``h`` (``cached_index``, ``downscale_needed``: the
    module's own functions, for the span's ends)."""
    cdef list vs = [float(v) for v in values]
    cdef list positive, counts
    cdef double v, s = 0.0, mn, total, lo_d = 0.0, hi_d = 0.0, lo_v = 0.0, hi_v = 0.0
    cdef bint has_lo, has_hi, any_positive = False
    cdef Py_ssize_t n = len(vs), i, zeros = 0
    cdef long long offset, first, last, end, k
    cdef int scale
    if not n:
        return
    mn = vs[0]
    for v in vs:  # sum(vs) and min(vs), as Python works them out
        s += v
        if v < mn:
            mn = v
    if not (s < INF and mn >= 0.0):  # a NaN or an infinity makes the sum one
        for x in values:
            h.add(x)
        return
    total = h.sum
    has_lo, has_hi = h.min is not None, h.max is not None
    if has_lo:
        lo_d = h.min
    if has_hi:
        hi_d = h.max
    for v in vs:
        total += v
        if not has_lo or v < lo_d:
            lo_d, has_lo = v, True
        if not has_hi or v > hi_d:
            hi_d, has_hi = v, True
        if v != 0.0:
            if not any_positive:
                lo_v = hi_v = v
                any_positive = True
            else:
                if v < lo_v:
                    lo_v = v
                if v > hi_v:
                    hi_v = v
        else:
            zeros += 1
    h.sum = total
    h.min = lo_d if has_lo else None
    h.max = hi_d if has_hi else None
    h.count += n
    h.zero_count += zeros
    if not any_positive:
        return
    scale = h.scale
    first, last = cached_index(lo_v, scale), cached_index(hi_v, scale)
    counts = h.counts
    if counts:
        offset = h.offset
        end = offset + len(counts) - 1
        if offset < first:
            first = offset
        if end > last:
            last = end
    k = downscale_needed(first, last, h.max_size)
    if k:
        if h.counts:
            h._rebucket(scale - k)
        else:
            h.scale = scale - k
        scale, first, last = scale - k, first >> k, last >> k
    if not h.counts:
        h.offset, h.counts = first, [0] * (last - first + 1)
    elif first < h.offset or last > h.offset + len(h.counts) - 1:
        end = h.offset + len(h.counts) - 1
        h.counts = [0] * (h.offset - first) + h.counts + [0] * (last - end)
        h.offset = first
    counts, offset = h.counts, h.offset
    for v in vs:
        if v != 0.0:
            counts[exp_index_c(v, scale) - offset] += 1


# -- GraderWindow.add_many --------------------------------------------------------------------

def grader_add_many(w, list calls, max_sum):
    """``GraderWindow.add_many(calls)`` for ``w``."""
    cdef list durations = []
    cdef dict causes = w.causes
    w._body = None
    w.graded += len(calls)
    tokens_in = tokens_out = 0
    for duration, n_in, n_out, cause in calls:
        durations.append(duration)
        tokens_in += n_in
        tokens_out += n_out
        if cause is not None:
            causes[cause] = causes.get(cause, 0) + 1
    w.input_tokens = min(w.input_tokens + tokens_in, max_sum)
    w.output_tokens = min(w.output_tokens + tokens_out, max_sum)
    w.durations.add_many(durations)
    if w.closed:
        w.dirty = True


# -- RunProcessor.on_records ------------------------------------------------------------------

cpdef tuple grader_call(dict span, ns, max_tokens, causes, unknown):
    """``GraderWindow.call_of(span)`` (``ns``, ``max_tokens``, ``causes``, ``unknown``: figures.py's
    NS, MAX_JUDGE_TOKENS, CAUSES and UNKNOWN_CAUSE)."""
    tokens_in = span.get("judge_input_tokens")
    tokens_out = span.get("judge_output_tokens")
    outcome = span.get("outcome") or "ok"
    return (max(span["end_time_ns"] - span["start_time_ns"], 0) / ns,
            tokens_in if tokens_in is not None and 0 < tokens_in <= max_tokens else 0,
            tokens_out if tokens_out is not None and 0 < tokens_out <= max_tokens else 0,
            None if outcome == "ok" else outcome if outcome in causes else unknown)


def on_records(p, run, topic, list records, now_ns, batch_class, tuple call_of, spans_topic, otlp_prefix,
               checkpoint_rule, alert_book):
    """``RunProcessor.on_records``' pass over one message's records, up to its closing pass: the
    outputs so far (``p``: the processor; the other arguments are the names runs.py reads from its
    module: Batch, grader_call's constants (NS, MAX_JUDGE_TOKENS, CAUSES, UNKNOWN_CAUSE),
    SPANS_TOPIC, OTLP_WRITER_PREFIX, checkpoint_rule, AlertBook)."""
    ns, max_tokens, causes, unknown = call_of
    cdef list out = []
    cdef dict r
    cdef bint sparse = False, spans
    marks, progress = run.marks, run.progress
    attempt = None
    writer = None
    stream, last, latest = "", 0, None
    batch = batch_class()
    rollouts, graders, size = batch.rollouts, batch.graders, p.size_ns
    spans = topic == spans_topic
    try:
        for r in records:
            if r["attempt"] != attempt or r.get("writer_id", "") != writer:
                p._settle(marks, progress, stream, last, latest, now_ns)
                attempt, writer = r["attempt"], r.get("writer_id", "")
                stream = f"{topic}|{attempt}|{writer}"
                last, latest = marks.get(stream, 0), None
                sparse = writer.startswith(otlp_prefix)
            seq = r.get("writer_sequence") or r.get("sequence_id") or 0
            if seq > 0:
                if seq <= last:
                    p.duplicates += 1
                    continue
                if last and seq > last + 1 and not sparse:
                    p._gap(run, stream, last, seq)
                last = seq
            t = r["time_ns"]
            if latest is None or t > latest:
                latest = t
            if spans:
                kind = r["kind"]
                if kind == "GRADER":
                    term = r.get("term")
                    if term is not None:
                        lists = graders.get((attempt, r.get("step"), term, t - t % size))
                        if lists is None:
                            p._grader(run, r, batch)
                        else:
                            call = grader_call(r, ns, max_tokens, causes, unknown)
                            for items in lists:
                                items.append(call)
                elif kind == "ROLLOUT":
                    step = r.get("step")
                    if step is None:
                        pass
                    elif r.get("status") == "ERROR":
                        p._failed_rollout(run, r, batch)
                    elif r.get("reward") is not None:
                        found = rollouts.get((attempt, step))
                        reward, shares, tokens = r["reward"], r.get("term_shares"), r.get("completion_tokens")
                        if found is not None and -INF < reward < INF and (
                                not shares or -INF < sum(shares.values()) < INF) and (tokens is None or tokens >= 0):
                            found.append(r)
                        else:
                            p._rollout(run, r, batch)
                elif kind == "CHECKPOINT":
                    out += [p._alert(run, a) for a in checkpoint_rule(alert_book(run.alerts), r, now_ns)]
            else:
                out += p._step_event(run, r, now_ns)
    finally:
        try:
            batch.apply()
        finally:
            p._settle(marks, progress, stream, last, latest, now_ns)
    return out


# -- RunProcessor._close ----------------------------------------------------------------------

def close(p, run, now_ns, bint idle, window_order, window_parts, step_order, forget_run):
    """``RunProcessor._close(run, now_ns, idle)``: the closing pass after a message or a tick (``p``:
    the processor; the other arguments are the helpers runs.py reads from its modules)."""
    cdef list out = []
    cdef dict windows, steps
    cdef bint due
    progress = p._progress(run)
    size, late, retention = p.size_ns, p.lateness_ns, p.retention_ns
    windows = run.windows
    for key in sorted(windows, key=window_order):
        w = windows[key]
        attempt, term, start = window_parts(key)
        start_ns = int(start)
        due = idle or (progress is not None and progress >= start_ns + size + late)
        if not w.closed and due:
            w.closed = True
            out += p._emit_window(run, int(attempt), term, start_ns, w, now_ns, first=True)
        elif w.dirty:
            out += p._emit_window(run, int(attempt), term, start_ns, w, now_ns, first=False)
        if w.closed and progress is not None and progress >= start_ns + size + late + retention:
            p._retire_window(run, key)
    steps = run.steps
    for key in sorted(steps, key=step_order):
        f = steps[key]
        attempt_no, step = step_order(key)
        due = idle or (f.end_ns is not None and progress is not None and progress >= f.end_ns + late)
        if not f.closed and due:
            f.closed = True
            out += p._emit_step(run, attempt_no, step, f, now_ns, first=True)
        elif f.dirty:
            out += p._emit_step(run, attempt_no, step, f, now_ns, first=False)
        if f.closed and f.end_ns is not None and progress is not None and progress >= f.end_ns + late + retention:
            p._retire_step(run, key)
    if progress is not None:
        step_ends = run.step_ends
        for key in [k for k, t in step_ends.items() if t + late + retention <= progress]:
            del step_ends[key]
        # a stream far behind and long silent (an ended attempt, a stopped writer) is forgotten;
        # its sequence mark stays, so a replay of it is still recognised
        run_progress = run.progress
        for key in [k for k, (t, r) in run_progress.items()
                    if t + retention < progress and now_ns - max(r, p.quiet_from(run)) > retention]:
            del run_progress[key]
    for ended in list(run.ended):
        if not any(k.split("|")[0] == str(ended) for k in list(run.steps) + list(run.windows)):
            forget_run(run.rules, run.project, run.run_id, ended)  # its step-rule state goes with it
    if run.alerts:  # after the steps and windows above were judged: a final-step alert fires, then resolves
        out += p._end_alerts(run, now_ns, idle)
    return out


# -- RunStage.on_message ----------------------------------------------------------------------

def one_run(list records):
    """True when every record names the first one's project and run_id (a message of one run, as
    writers send them): ``RunStage.on_message`` then groups nothing."""
    cdef dict r
    if not records:
        return False
    r = records[0]
    project, run_id = r["project"], r["run_id"]
    for r in records:
        if r["project"] != project or r["run_id"] != run_id:
            return False
    return True


# -- ExpHistogram.encode and ExpHistogram.quantiles -------------------------------------------

def exp_encode(h, max_size_default):
    """``ExpHistogram.encode()`` for ``h`` (``max_size_default``: histograms.py's MAX_SIZE)."""
    cdef list counts = []
    cdef Py_ssize_t zeros = 0
    for c in h.counts:
        if c:
            if zeros:
                counts.append(-zeros if zeros > 1 else 0)
                zeros = 0
            counts.append(c)
        else:
            zeros += 1
    out = [h.scale, h.zero_count, h.offset, counts, h.count, h.sum, h.min, h.max]
    if h.max_size != max_size_default:
        out.append(h.max_size)
    return out


def exp_quantiles(h, tuple qs):
    """``ExpHistogram.quantiles(qs)`` for ``h``."""
    cdef list out, counts
    cdef Py_ssize_t i, n
    if not all(0.0 <= q <= 1.0 for q in qs):
        raise ValueError(f"quantiles must be within [0, 1], got {qs!r}")
    if h.count == 0 or h.min is None or h.max is None:
        raise ValueError("quantile of an empty histogram")
    lo, hi, count = h.min, h.max, h.count
    out = []
    seen, counts, i, n = h.zero_count, h.counts, 0, len(h.counts)
    for q in qs:
        rank = max(1, math_ceil(q * count))  # Python's: an int, as the method's
        if rank == 1:
            out.append(lo)
        elif rank == count:
            out.append(hi)
        elif rank <= h.zero_count:
            out.append(0.0)
        else:
            while i < n and rank > seen + counts[i]:  # the bucket holding this rank; ranks only grow
                seen += counts[i]
                i += 1
            if i == n:
                out.append(hi)  # unreachable while count matches the buckets
            else:
                mid = 2.0 ** min((h.offset + i + 0.5) / 2.0**h.scale, 1023.0)
                out.append(min(max(mid, lo), hi))
    return out
