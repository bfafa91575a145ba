"""Where does a small decode step spend its time? Graph-timed decode (its split states merged in the same
launch), the stand-alone merge of the same states, at B1 KV8192 and KV64 32/8 D128 f16, for a few split
counts. Scratch tool for tuning; PROBE_NCU_SPLITS=n and PROBE_NCU_PREFILL=1 make targets for ncu,
PROBE_NCU_PEER=1 one of our decode beside torch SDPA's kernel (PROBE_NCU_KV); PROBE_ROWS=decode,prefill
prints just the benchmark rows of the issue's targets (with their peers; decode plain and pdl;
PROBE_DECODE=1x8192x32x8x128,... a subset of the decode rows), PROBE_ROWS=sweep block
shapes x split counts (PROBE_SWEEP_KV, PROBE_SWEEP_SPLITS),
PROBE_ROWS=wide head_dim 256 with one KV head by split count (PROBE_WIDE_SPLITS); sweep and wide rows with the
split states merged in the decode's last block and apart (merge_states launched after it), PROBE_APART=0,1;
PROBE_ROWS=wait the counted merge against merge_wait beside torch SDPA, in turns (PROBE_DECODE as for decode;
PROBE_WAIT_CFG=8:16,4:16 warps:splits pairs instead of the plan's own).

2026-11-26 (H100, ncu on the PROBE_NCU_SPLITS=16 target, B1 KV8192 32/8 D128, decode_tc w8): 176 registers
and 210 KB of shared memory hold it to 8 warps per SM; issue active 22%; about half of the warp stall samples
fall before the first tile is computed: the seq_ids -> lengths -> page-table load chain, and q's load after
pdl_wait (16% of all samples on its first use), which queues behind the prologue's K/V copies. Taking the
page-table loads off the length (clamped to the page-table row without a window) changed nothing measurable
(pdl 17.16/17.21 -> 17.30/17.06 us); not kept.

2026-11-26, later (H100, pdl, graph; each comparison from one run):
  * K/V by bulk copies (one 256-byte cp.async.bulk per key slice and lane, an mbarrier per ring stage) in
    place of 16-byte cp.async, so that q's loads after pdl_wait are not queued behind the prologue's
    copies: B1 KV8k 32/8 D128 16.99 vs 17.04 us, KV32k 50.46 vs 49.13, KV128k 190.25 vs 191.16, B32 KV4k
    190.96 vs 184.18, 8/1 D256 13.34 vs 13.44, 4/1 D256 10.89 vs 11.22. Not kept.
  * Where B1 KV8k 32/8 D128 (w8 s16, 17.2 us) goes, by variants that skip work: without the split merge
    14.17 us (80% of copy), without the tiles' S/softmax/PV 15.42, without both 12.76 (89%: the rate of
    a plain read stream of those bytes, attention_stream.py, 12.7 us). w4 s33: 18.88 -> 13.77 without the
    merge. KV128k w4 s33: 188.46 -> 183.85 without the merge, 182.73 without both (SDPA 180.4 in an
    earlier run). So the merge (fence, counter, the last block's loads: L2 round trips after the last
    tile) is the largest cost at 8k, ~3 us.
  * The split states merged inside a cluster of the n_splits blocks through distributed shared memory (no
    partials in global memory, no counter): correct (GPU tests passed), but slower under pdl: w8 s8 KV8k
    18.66 us against 17.77 (s8, last-block merge) and 17.2 (s16), KV32k s8 57.7 against 49.1; plain
    19.55 against 19.16. H100 cluster capacity (cuOccupancyMaxActiveClusters, one 209 KB block per SM):
    15 clusters of 8, 7 of 16, so a 16-split grid of 8 KV heads does not fit one wave. Not kept.
  * Every ring stage filled in the prologue (NS tiles in flight before q is read, a stage refilled after its
    tile is computed) instead of NS - 1: correct, but B1 KV8k 17.82 against 17.14 us, 8/1 D256 14.12
    against 13.17, 4/1 D256 11.58 against 10.98 (KV128k and B32 KV4k unchanged). Not kept.

2026-11-26, seventh session (H100, pdl, graph; old and new sources in turns, PROBE_DECODE rows):
  * The split states as flagged words (each f32 beside a per-launch flag in one 64-bit relaxed store; the
    flag a per-(query, head block) counter + 1 read after pdl_wait and advanced by the merger), merged by
    the block of the last split, which waits for the flags: no fence, no atomic, no last-block election.
    Correct (56 decode/merge GPU tests passed, plus a test that stale words are never merged), but slower:
    B1 KV8k 32/8 D128 17.71-17.98 us against 17.20-17.23, KV32k 51.1-51.5 against 49.4-49.9; and the
    merge_apart row 8/1 D256, which takes none of it, 14.35-14.45 against 13.58-13.70 (not explained; one
    guess: decode_tc<256, 4> went from 254 to 255 registers with the flag live across its main loop). The
    fences it removes cost ~1 us (next item); the doubled reads of the merging block (64 KB of L2 per head
    block with the flags) and the polling cost more than that back. Not kept.
  * Where the fused merge's ~3 us go at B1 KV8k 32/8 D128 (macro-guarded variants of decode_finish, two
    rounds in turns): whole 17.13 us; without the merge's loads and combine (the elected block writes
    zeros) 15.20; without the two fences (timing only) 16.1; without anything after the partial writes
    14.1. So ~1.9 us are the merging block's own work and ~1 us the fences. Kept: the election by one
    acq_rel atomic of thread 0 after the barrier (one MEMBAR.ALL + the atomic + an L1 invalidate, where
    every thread's fence.sc, the atomic and a second fence were), and the merge's columns split over
    pairs of threads where the block has twice as many threads as (head, float4 column)s (each merging
    every other state, combined by shuffles): KV8k 17.18-17.23 -> 16.41-16.47 us (66 -> 69% of copy),
    KV32k 49.1 -> 48.8-48.9, KV128k unchanged (191.0-191.6).
  * Layout: B8 with one KV head each (every head's page rows contiguous, 4 KB per page) against B1 with
    8 KV heads (a head's 256-byte rows 2 KB apart), the same bytes: KV128k 193.2 / 191.3 us, KV32k
    49.7 / 49.6 (pdl). The interleaved page layout costs nothing measurable.
  * Sweep after the merge change (PROBE_ROWS=sweep, fused merge, pdl; the plan's pick w8 s16 at all three):
    KV8k w8 s8/16/24/33 17.6/16.5/20.8/24.8 us, w4 22.1/17.6/18.6/18.2; KV32k w8 53.3/49.0/57.5/61.9, w4
    68.6/51.8/55.5/51.8; KV128k w8 202.0/191.4/199.2/197.1, w4 250.8/205.6/206.7/188.2. Only KV128k has a
    better configuration than the split model's (w4 s33, 1.7%: the model puts w4 s16 at 192 us where it
    takes 206, two blocks per SM overlapping each other's tails); still 0.96x SDPA (180.6), so the model
    was left as it is. memcheck (25 decode split tests) 0 errors; racecheck (7) 0 hazards.

2026-11-26, eighth session (H100, pdl, graph, fused merge, one run, copy 2,870 GB/s): would a grid that fits
beside the previous launch's merging blocks (8 KV heads x 15 splits = 120 blocks against the 124 SMs those 8
blocks leave free) start every block of the next launch at once and pay? No: PROBE_ROWS=sweep
PROBE_SWEEP_SPLITS=12,14,15,16, B1 32/8 D128, w8: KV8k 17.31 / 17.24 / 17.34 / 16.32 us, KV32k 54.45 / 51.40 /
49.81 / 48.92; w4 KV8k 19.18 / 18.30 / 17.66 / 17.55. The model's 16 splits stay best (512 keys: four whole
16-key tiles per warp at w8).

2026-11-26, eleventh session (H100):
  * The peer. torch SDPA at B1 32/8 D128 runs cuDNN's sdpa_sm80_flash_fprop_wmma_f16 16x128x128 kernel: one
    launch (no combine kernel), 256 blocks of 4 warps, 86 KB of shared memory, two blocks per SM. ncu
    (PROBE_NCU_PEER=1, clocks at ncu's base): KV128k cuDNN 180.4-181.6 us, DRAM throughput 89% of peak, L2
    read sectors from the SMs 16.8 M = the K/V bytes once; ours (w8 s16) 200.8-208.8 us, 77-80%, 25.2 M
    sectors (1.5x: ~11.4 M of them L2 hits), DRAM bytes read the same 537 MB. KV8k: cuDNN 18.4-18.5 us, ours
    21.8-21.9 (eager, no pdl). attention_stream.py's head pattern (256-byte slices at a 2 KB stride) asks L2
    for the bytes once (1.0x, 178.7 us): the extra sectors come with our cp.async copies into shared rows
    padded to D + 8, not with the page layout.
  * Those copies with an XOR swizzle instead of the pad (rows 128-byte aligned, chunk ^ (row & 7); a
    macro-guarded variant, correct): L2 sectors 2.0x, and slower in turns -- KV8k 16.41-16.66 -> 16.72-16.80
    us, KV32k 49.2-49.4 -> 51.3-51.5, KV128k 190.4-191.1 -> 192.8-193.5. Not kept. The bulk-copy variant of
    an earlier session (which sidesteps cp.async) gained 0.5% at KV128k and lost elsewhere, so the extra
    sectors are not where the gap to cuDNN is.
  * The evict-first test inside decode_tc's copy loop is if-converted: both copy forms are issued, one
    predicated off (2.1 M LDGSTS executed at KV128k for 1.05 M that move data). Without the evict-first
    form at all: KV8k 16.32 -> 16.04 us, KV128k 189.9 -> 193.6 (the policy pays there); one copy form with
    the policy chosen at run time (evict-normal otherwise): equal to today's (16.34 / 188.8); the test
    hoisted out of the loop (two unpredicated copy loops, a uniform branch): KV8k 16.35 -> 16.18, KV32k
    48.8 -> 49.25, KV128k 189.8 -> 189.3, 8/1 and 4/1 D256 within 0.5%. Mixed; not kept.
  * More, smaller blocks do not balance the long decode (KV128k, pdl, sweep): w4 s16/33/66/99/132/198/256
    205.2/188.8/203.8/203.0/205.7/209.7/217.7 us, w8 192.0/197.6/198.4/202.3/213.8/213.0/221.3.
  * Page layout (pdl, the default plan, same bytes): KV128k B1 32/8 page 16 190.5-190.8 us, page 256 186.7-
    187.4; B8 4/1 (every head's rows contiguous) page 16 190.6-191.5, page 256 (64 KB runs) 189.8-190.0.
    KV8k 16.4-16.5 / 16.2-16.3 / 16.7 / 16.5-16.6. Longer contiguous runs do not close the gap either.

2026-11-26, twelfth session (H100, copy 2,880 GB/s, pdl, graph, the default plans, three runs in turns): an
in-loop L2 prefetch (each warp asks L2, by cp.async.bulk.prefetch of its lanes' 256-byte K and V slices, for
its tile A tiles after the one it copies next; a run-time DecodeParams field in the variant) to put more of a warp's stream in
flight than its three-stage ring holds. Slower at every distance, the more the further ahead: B1 32/8 D128
KV8k A = 0/2/4/8 15.87/16.80/16.80/16.80 us, KV32k 48.4/51.5/56.8/65.4, KV128k 190.5/188.2-192.3/209.8/323.5,
B32 KV4k 183.9/183.5/205.6/311.4. Not kept in that form. The same with one prefetch.global.L2 per 128-byte
line (macro-guarded variants, scratch A/B in turns) is a different story at long chunks: KV128k w8 s16 A = 0/1/2/3
191.5/183.6/182.4/185.6 us (torch SDPA 181.3 in the same session), w4 s33 187.1/184.3/183.6/186.8; with the
lines' eviction priority evict_last A = 4 still lost (211 us, so it is not L2 thrash: the prefetches crowd out
the ring's copies), and a prefetch every 32 bytes (four per line) 312 us; one line per 256-byte slice (half of
it) gained nothing (193.3). Short chunks lose (KV8k +0.6-1 us, KV32k +1 us). Kept as DecodeParams.l2_ahead =
2 from 48 tiles a warp (AttentionDispatch._ahead_tiles; PROBE_ROWS=ahead, PROBE_AHEAD=0,1,2 measures it); the
pre-wait prefetch moved to the line form too (KV8k -2% in three runs).
  Also measured: every tile of a short chunk into L2 before the wait and no cp.async before it
(CUKERN_DECODE_EARLY=0, bulk or lines), KV8k 16.7-17.0 us against 15.9; the pre-wait prefetch of 2-3 tiles by
lines after 1-2 ring tiles, 16.7-17.4. The more of a launch's bytes are asked for before its wait, the slower the
step: those requests delay the previous launch's last tiles and merge, which the wait is waiting for.
  The split election with the arrival first and the publication after (one counter word: arrivals in the
low 16 bits by an acquire add, publications in the high 16 by a release reduction after the block's partial
stores; the last block to arrive merges at once when every other block has published, else polls; so its
own partial needs no release fence): the same outputs, bit for bit, but KV8k w8 s16 16.51-16.62 us against
15.66-15.73 (w4 s33 17.05-17.16 against 17.04-17.31), KV32k and KV128k equal in turns. Not kept.

2026-11-26, thirteenth session (H100, pdl, graph, the default plan w8 s16, B1 32/8 D128; variants of the unit by
defines, three runs in turns):
  * Page-table lookups. Pool rows computed from the key alone (valid only for the benchmark's in-order pages, a
    measuring variant): KV8k 15.72-15.91 -> 15.25-15.61 us, KV32k 49.0-49.4 -> 48.0-48.6, KV128k 181.9-182.6 ->
    181.2-182.5; the same in the tile loop only: KV32k 48.1 (all of the gain), KV8k 15.7 (none); page size 256 (one
    page-table word per 16 tiles) matches it (KV8k 15.2-15.4, KV128k 180.7-181.0). The SASS showed why in the
    loop: the row was formed (shift, add) right after its page-table load, so the warp waited for the load where
    it issued it. Kept: lookup() returns the raw entry and row_of() forms the row where the copies use it, a tile
    later (KV8k 15.66-15.89 -> 15.57-15.66, KV32k 48.54-48.82 -> 48.20-48.37, KV128k 182.1-182.5 -> 181.7-182.2).
    A two-deep queue of rows (looked up two tiles ahead, but still formed at once) gained nothing; prefetching
    the page-table line into L1 four tiles ahead lost at KV128k (184 us).
  * Where KV8k's remaining time goes (macro-guarded variants of decode_finish, not kept): whole 15.60-15.71 us
    (74% of copy); without the merging block's loads, combine and stores (the election still made) 13.97-14.04
    (83%); without the acq_rel election either (every block writes its partial and leaves) 13.13-13.18 (88%, the
    rate of a bare read stream of these bytes). KV128k: 181.5-182.1, 179.8-180.3, 178.8-179.1 (torch SDPA
    180.4-182.3). So at 8k the split merge (one L2 round trip of the merging block's loads ~1.6 us, the fence and
    atomic ~0.9 us, both under the next launch's prologue traffic) is what stands between 74% and 80%+ of copy.
  * ncu --graph-profiling graph over four pdl steps: DRAM bytes read per step 540 MB at KV128k (537 MB of K/V),
    33.6 MB at KV8k: nothing is read twice; L2 read sectors 2.0x the bytes (the prefetches count), torch SDPA's
    cuDNN kernel 1.5x.
  * Plan alternatives at KV128k (same run): w8 s16 fused merge 181.4-181.8 us, w8 s16 merge_apart 183.1-183.2, w4
    s33 184.0-184.2, w4 s33 apart 183.3-184.1, w8 s12 205.9-206.1 (SDPA 181.0-181.5). The default stays.

2026-11-27, fourteenth session (H100, pdl, graph, the default plan w8 s16, B1 32/8 D128, variants in turns with
torch SDPA): merge_wait, where the grid is resident at once the merging block is fixed and polls the other
blocks' states, whose f32 words carry the launch's parity in their lowest bit (relaxed stores and loads; no
fence, no atomic, no election; the parity from an epoch word per grid row, copied in with the tiles and flipped
by the merger):
  * the last split's block merging, polling its states one after another (one L2 round trip for every state
    that arrived after the one it waited on): KV8k 16.0 -> 15.9 us, KV32k 48.6 -> 51.2, KV128k 182.7 -> 184.4;
    polling every unwritten state together: KV8k 16.0 -> 15.2 (72 -> 76% of copy), KV32k equal, KV128k 182.2 ->
    181.4;
  * the backoff between polls capped at 256 / 64 / 0 ns: equal (15.0 us);
  * the first split's block merging (dispatched first, it is polling already when the last state lands): KV8k
    15.0 -> 14.8 us, KV32k and KV128k equal. Kept. In one run: counted 15.7-15.8 us, merge_wait 14.74-14.89
    (76.7%), SDPA 18.3-19.1; KV128k 181.3-181.4 / 180.5-180.6 / SDPA 180.7-181.0 (parity);
  * with it, the pre-wait L2 prefetch at KV8k off / 2 tiles (the rule's is 1): 15.5 / 16.0 us; one prologue tile
    before the wait (CUKERN_DECODE_EARLY=1): 15.1; KV128k prefetch 2 tiles (the rule's 3): 180.0-180.3 against
    180.5-180.6, off 191.2. The rule stays.
  * A software-pipelined tile loop (the S mma chain of tile i + 1 interleaved with O += P V of tile i, after tile
    i's softmax, the next tile's copies issued before the wait; 215 registers at D128 against 186): correct (73
    decode/merge GPU tests passed) but slower, KV8k 14.89 -> 15.2 us, KV32k 48.1 -> 48.3, KV128k 180.8 -> 181.2.
    Not kept: the tiles' compute is not what is left at 8k. What is: the bare stream (every block writes its
    partial and leaves, nothing merged) took 13.15 us (88% of copy) and the merge, counted or waiting, adds
    ~1.65 us after the slowest block's state (one L2 round trip of the merger's loads under the next launch's
    prologue traffic, the combine, the O store before the grid can end), so 80% (14.1 us) needs a merge
    without an L2 round trip, i.e. in distributed shared memory, which a 16-block cluster per KV head cannot
    give on H100 (7 such clusters fit, 8 are needed).
  * merge_wait was the plan's default for a while (with it: test_attention + test_models 152 passed, memcheck
    decode/merge 67 passed 0 errors, racecheck 54 passed 0 hazards; bench_attention B1 KV8k pdl 14.90 us, 77% of
    copy, 1.26x SDPA; KV128k 180.48 against 180.88, 1.00x). Then, after the epoch read became a 16-byte copy
    through L2 (it was a 4-byte cp.async.ca), test_decode_tc_warps[float16-128-8-ahead2] failed once in six warm
    runs of the decode/merge tests (pytest -n 8, a new seed each), and one test of a cold run failed unnamed;
    each passed alone on rerun. Not explained (in those tests each plan launches once, epoch 0 over buffers of
    parity 1; the low-bit tag moves an LSE by one unit in the last place, which a float64 replay of the test's
    split merges shows cannot reach its 1e-4 tolerance), and no device time was left to tell whether merge_wait
    or the counted merge is at fault (same seeds, AttentionDispatch._merge_wait on and off). So merge_wait is
    opt-in (a probe setting) and the counted merge stays the default.

2026-11-27, fifteenth session (H100, pdl, graph, B1 32/8 D128 unless said; variants in turns with torch SDPA):
  * The merge_wait mismatch of the session before did not come back. Scratch runs of test_decode_tc_warps (both
    block shapes, both dtypes, in-loop prefetch by the rule and forced) and test_decode_merge_wait (every
    parametrisation) called directly over 48 seeds in 8 processes at once, merge_wait on and off: 0 failures in
    672 calls each way. pytest -n 8 of the decode and merge tests with merge_wait forced on (a plugin patching
    AttentionDispatch.__init__), seeds 101-105 and 200-239: 45 runs, each 73 passed. Still unexplained, so
    merge_wait stays opt-in.
  * Does the next launch gain from fitting beside the 8 merging blocks (PROBE_ROWS=wait PROBE_WAIT_CFG)? No.
    KV8k counted / merge_wait: w8 s16 15.99-16.09 / 15.30-15.43 us, s15 16.16-16.27 / 15.66-15.73, s14
    16.21-16.28 / 15.38-15.49, s12 16.41-16.54 / 15.80-15.94; w4 s16 17.33-17.47 / 16.66-16.79, w4 s32
    17.15-17.23 (too many blocks for merge_wait); SDPA 18.7-19.4.
  * Fewer bytes in flight, so that the merge's L2 round trip queues behind less (a 2-stage ring, 17 KB a warp,
    instead of 3): slower everywhere. merge_wait KV8k 14.86-14.90 -> 15.21-15.34 us, KV32k 48.4-48.6 ->
    48.1-48.2 (one turn 52), KV128k 180.8-181.0 -> 182.1-182.4; counted 15.73-15.78 -> 16.09-16.11, KV128k
    181.9 -> 183.4 (SDPA 18.3-19.1 / 51.7-52.1 / 180.7-181.1).
  * Fewer splits with more of each block's chunk in L2 before the wait (merge_wait, pre-wait L2 prefetch pf
    tiles): KV8k s16 14.89-14.98 us, s8 15.88-15.97, s8 pf3 16.63-16.75, s8 pf6 18.2-18.3, s16 pf3 16.05-16.14,
    s10 16.55-16.68, s10 pf4 18.3-18.7, s12 pf4 17.7-18.1; KV32k s16 48.3-48.4, s8 50.5-50.8 (64 blocks still
    read at 90% of copy), s10 56.9-57.8. The plan's s16 and pf rule stay.
  * Clocks (attention_blocks.py BLOCKS_PAIR=1 BLOCKS_KV=8192, BLOCKS_WAIT=0 / 1; us from the first clocked
    launch's wait return): tiles done 6.6-9.0, most blocks leave by 10-11, the merging blocks at 18.7-19.8,
    the next launch's blocks enter at a median of 9.5-11 and return from their wait 0.38-0.42 us after the last
    block leaves, both ways. The merging blocks' loads wait behind the next launch's prologue copies. Holding
    that prologue back by a sleep on entry (a macro-guarded variant, not kept): merge_wait 15.05-15.20 us, 500 ns
    14.90-15.14, 1 us 15.00-15.04, 2 us 15.33-15.43, 4 us 16.03-16.18; counted 15.91-16.06, 1 us 15.73-15.95;
    KV128k flat to 2 us (181.0-181.7), SDPA 18.6-19.3 / 180.7-181.2. What the prologue loses is what the merge
    gains: no setting of how much is asked for before the wait, how deep the ring is, or where the merging
    block sits has moved KV8k past 77% of copy.
  * Strided splits (a macro-guarded variant, not kept): block s takes warp tiles s, s + n_splits, ... of the whole
    range instead of one contiguous chunk, so a head's blocks walk the keys side by side (the same outputs to
    4e-8). Counted, pdl: KV8k 15.91-15.99 -> 15.51-15.71 us, KV32k 48.3-48.6 -> 47.9-48.1, KV128k 182.0-182.9 ->
    183.6-184.1; plain: KV8k 18.4-18.8 -> 18.5-18.9, KV32k equal (54.3-55.0), KV128k 194.6-197.2 -> 203.7-204.6;
    merge_wait: KV8k equal (14.84-15.10), KV32k 48.2-48.5 -> 47.4-47.7, KV128k 181.5-182.2 -> 182.5-182.9 (SDPA
    18.8-19.4 / 52.0-52.4 / 180.9-181.1). The uneven long-KV streaming is not about where in the range a block
    reads.

2026-11-27, sixteenth session (H100, B1 32/8 D128, default plan w8 s16, graph, in turns with torch SDPA): a shared
tail pool, coarser than the ninth session's per-tile tickets. The last pool_keys visible keys of each query were
drawn by the warps of its blocks in units of 64 keys (4 warp tiles) from a per-row counter, each draw asked for
(lane 0's atomic add) 4 units before its first tile and broadcast 2 units before, so no warp waited for a draw
(~800 draws per KV head at KV128k with 40% pooled, against 8 k tickets per head in the ninth session); the
merging block reset the counter. Correct (the decode/merge GPU tests and a pooled test over ragged lengths, eight
graph-replayed launches, pdl and plain, w4 and w8: 71 passed; outputs within 4e-8 of the fixed split), but slower
at every length, plain launches too, which the pool was meant for: pool 0 / 25% / 40% of the keys, pdl KV8k
16.1-16.2 / 20.1-20.2 / 19.6-19.9 us, KV32k 49.2 / 51.8-52.0 / 51.5-51.7, KV128k 185.0-185.2 / 185.8 / 187.0;
plain KV8k 18.8-19.3 / 24.4-27.2 / 29.5-29.9, KV32k 55.1-55.8 / 58.5-59.3 / 59.2-59.5, KV128k 199.9-201.3 /
203.7-203.9 / 204.0-204.5 (SDPA 18.6-19.4 / 52.5-52.6 / 183.0). Not kept. With the blocks' ends evened out the
plain launch still takes ~8% longer than the pdl one, so that gap is not the slowest block's tail. What did close
most of it: without pdl decode_tc had streamed K/V evict-normal and asked L2 for nothing ahead below 48 tiles a
warp; evict-first wherever a warp prefetches, and one tile ahead from 16 tiles without pdl
(AttentionDispatch._ahead_tiles), took the plain rows from 0.90-0.96x torch SDPA to 0.98-1.00x (KV128k 197.3 ->
182.5 us, B32 KV4k 196.4 -> 181.7, B64 389.7 -> 357.4, KV32k 54.7 -> 51.9).

2026-11-27, seventeenth session (H100, B1 32/8 D128, pdl, graph, in turns with torch SDPA): the merge in distributed
shared memory, the one way past the merge's L2 round trip that the fourteenth session named. A cluster launch
(cuLaunchKernelEx, cluster = the n_splits blocks of a (query, head block), non-portable sizes above 8): the first
split's block, once its ring was free, signalled the others (a remote mbarrier arrive); each sent its state by
st.async into the merger's shared memory, counted on the merger's mbarrier, and left; the merger merged and stored O.
No partial buffer, counter or fence in global memory. Correct (a GPU test of five shapes, ragged lengths with empty
chunks, window, softcap, sinks and LSE, eager and graph-replayed, pdl and plain, against float64 and within 1e-6 of
the counted merge: 5 passed; A/B outputs within 3.4e-8). But clusters cost more than the merge they save:
  * how many clusters this H100 holds at once (cuOccupancyMaxActiveClusters), by blocks per cluster 2 ... 16: w8
    (209 KB of stages, one block an SM) 66 39 30 22 17 15 15 9 7 7 7 7 7 7 7, so 8 KV heads take at most 9 splits
    in one wave; w4 (104 KB, two an SM) 132 79 62 47 39 32 30 23 21 16 16 14 14 14 14;
  * KV8k: counted w8 s16 15.73-16.06 us (SDPA 18.6-19.4); cluster w8 s9 (the most that fit) 16.71-16.78, w8 s16
    (two waves) 21.5-21.7; w8 s8 cluster / counted 16.17-16.64 / 16.44-16.59 (the round trip it removes is worth
    ~0.25 us there); w4 s16 cluster / counted 18.07-20.15 / 17.18-17.89, w4 s12 cluster 17.13-17.47;
  * KV32k: counted s16 48.4-48.9; cluster w8 s9 55.1-55.3, w8 s8 55.8-57.3 (counted s8 50.8-51.3), w4 s16 61.9-62.1
    (counted 53.2-53.5); KV128k: counted 182.0-182.3 (SDPA 181.1-181.2), cluster w8 s9 218.7-219.9, s16 245.
So a cluster launch loses at every length and block shape, even where its grid fits in one wave (w4 s16, s8);
presumably because the next launch's clusters can only start where a GPC frees enough SMs at once, so they overlap
the previous launch's tail less than single blocks do (not measured). Not kept (nothing of it is in the tree)."""
from __future__ import annotations

import itertools
import os

import cupy

from cukern.attention import AttentionDispatch, PagedKVCache
from cukern.benchmark import time_graph_us


def _b1_decode_case(rng, kv_len: int, n_layers: int):
    """A B1 GQA 32/8 D128 f16 decode case: (cache of n_layers random layers, its sequence of kv_len
    tokens, q, out)."""
    cache = PagedKVCache(n_layers, -(-kv_len // 16), 16, 8, 128, max_seqs=1)
    for pool in (*cache.k_pools, *cache.v_pools):
        pool[...] = rng.standard_normal(pool.shape, dtype=cupy.float32).astype(pool.dtype)
    seq = cache.add(kv_len)
    q = rng.standard_normal((1, 32, 128), dtype=cupy.float32)
    return cache, seq, q, cupy.empty_like(q)


def _layer_steps(attn, plan, q, out, n_layers: int):
    """A decode call that moves to the next layer's K/V each time (so that DRAM, not L2, serves them)."""
    layer = itertools.count(1)
    return lambda: attn.flash_attn_decode(plan, next(layer) % n_layers, q, out)


def ncu_target(n_splits: int) -> None:
    """A few eager decode steps (B1 KV8192 32/8 D128, n_splits) for ncu --launch-skip 2 --launch-count 1."""
    attn = AttentionDispatch()
    rng = cupy.random.default_rng(0)
    kv_len = int(os.environ.get("PROBE_NCU_KV", "8192"))
    cache, s, q, out = _b1_decode_case(rng, kv_len, 1)
    plan = attn.plan_decode(cache, [s], 32, n_splits=n_splits)
    for _ in range(5):
        attn.flash_attn_decode(plan, 0, q, out)
    cupy.cuda.get_current_stream().synchronize()


def ncu_peer() -> None:
    """Three eager B1 32/8 D128 decode steps (KV PROBE_NCU_KV, the default plan), then three torch SDPA calls at
    the same shape (contiguous K/V, enable_gqa), for ncu --kernel-name regex:"decode|sdpa|flash|fmha"."""
    import torch
    import torch.nn.functional as F
    attn = AttentionDispatch()
    rng = cupy.random.default_rng(0)
    kv_len = int(os.environ.get("PROBE_NCU_KV", "131072"))
    cache, s, q, out = _b1_decode_case(rng, kv_len, 1)
    plan = attn.plan_decode(cache, [s], 32)
    for _ in range(3):
        attn.flash_attn_decode(plan, 0, q, out)
    cupy.cuda.get_current_stream().synchronize()
    tq = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 8, kv_len, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    for _ in range(3):
        F.scaled_dot_product_attention(tq, k, v, enable_gqa=True)
    torch.cuda.synchronize()


def ncu_prefill() -> None:
    """A few varlen causal prefills, B1 L4096 32 heads D128 f16, for ncu --launch-skip 2 --launch-count 1."""
    import numpy as np
    attn = AttentionDispatch()
    rng = cupy.random.default_rng(0)
    n, h, d = 4096, 32, 128
    q, k, v = (rng.standard_normal((n, h, d), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
    cu = cupy.asarray(np.array([0, n], np.int32))
    out = cupy.empty_like(q)
    for _ in range(4):
        attn.flash_attn_varlen(q, k, v, cu, cu, out, max_seqlen_q=n, causal=True)
    cupy.cuda.get_current_stream().synchronize()


def target_rows(which: str) -> None:
    """The issue's target rows of bench_attention (same code, same peers), without the rest of the table."""
    import importlib.util
    import pathlib
    spec = importlib.util.spec_from_file_location("bench_attention",
                                                  pathlib.Path(__file__).with_name("bench_attention.py"))
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)
    attn = AttentionDispatch()
    ceil = b.measure_ceilings()
    rng = cupy.random.default_rng(0)
    print(f"copy ceiling {ceil.copy_gbs:.0f} GB/s")

    def show(r):
        ratio = f" {r.peer_us / r.us:.2f}x peer ({r.peer_us:.2f} us)" if r.peer_us else ""
        rate = f"{r.gbs:,.0f} GB/s" if r.gbs else f"{r.tflops:.1f} TFLOP/s"
        pct = f" {100 * r.pct_ceiling:.0f}%" if r.pct_ceiling else ""
        print(f"{r.kernel:28s} {r.shape:28s} {r.us:8.2f} us {rate}{pct}{ratio}", flush=True)
    attn_pdl = AttentionDispatch(pdl=True)
    aparts = [bool(int(x)) for x in os.environ.get("PROBE_APART", "0,1").split(",")]  # where split states merge
    if "decode" in which:
        cases = [(1, 8192, 32, 8, 128), (1, 32768, 32, 8, 128), (1, 131072, 32, 8, 128), (32, 4096, 32, 8, 128),
                 (1, 8192, 8, 1, 256), (1, 8192, 4, 1, 256), (1, 512, 4, 1, 256)]
        if os.environ.get("PROBE_DECODE"):  # a subset, e.g. 1x8192x32x8x128,1x32768x32x8x128 (batch x kv x h x hk x d)
            cases = [tuple(int(v) for v in c.split("x")) for c in os.environ["PROBE_DECODE"].split(",")]
        for args in cases:
            for r in b._decode_rows(attn, ceil, rng, *args, attn_pdl=attn_pdl):
                show(r)
    if "sweep" in which:  # decode_tc's block shapes x split counts x KV lengths (B1 32/8 D128), plain and pdl
        kvs = [int(x) for x in os.environ.get("PROBE_SWEEP_KV", "8192,32768,131072").split(",")]
        splits = [int(x) for x in os.environ.get("PROBE_SWEEP_SPLITS", "8,16,33,66").split(",")]
        for nw, apart in itertools.product((4, 8), aparts):
            attn._tc_warps, attn._merge_apart = nw, apart
            for kv in kvs:
                for s in splits:
                    for r in b._decode_rows(attn, ceil, rng, 1, kv, 32, 8, 128, n_splits=s,
                                            label=f"w{nw}{' apart' if apart else ''}", attn_pdl=attn_pdl):
                        show(r)
        attn._tc_warps = attn._merge_apart = None
    if "wide" in which:  # head_dim 256, one KV head (8/1, Gemma 3's 4/1) at KV8k by split count: the merge's cost
        for h, apart in itertools.product((8, 4), aparts):
            attn._merge_apart = apart
            for s in [int(x) for x in os.environ.get("PROBE_WIDE_SPLITS", "8,16,24,32,48,64").split(",")]:
                for r in b._decode_rows(attn, ceil, rng, 1, 8192, h, 1, 256, n_splits=s,
                                        label=f"s{s}{' apart' if apart else ''}", attn_pdl=attn_pdl):
                    show(r)
        attn._merge_apart = None
    if "prefetch" in which:  # pdl with decode_tc's L2 prefetch of each warp's next tiles before the wait
        def pairs(name, default):  # "a:b,c:d" -> [(a, b), (c, d)]
            return [tuple(int(v) for v in x.split(":")) for x in os.environ.get(name, default).split(",")]
        kvs = [int(x) for x in os.environ.get("PROBE_PF_KV", "8192,32768,131072").split(",")]
        for kv, apart in itertools.product(kvs, aparts):
            attn._merge_apart = apart
            for nw, n_splits in pairs("PROBE_CFG", "4:16,4:33,8:16"):  # warps:splits
                attn._tc_warps = nw
                for pf, ef in pairs("PROBE_PF", "0:0,0:1,2:0,4:0,4:1,8:0,8:1,16:1"):  # prefetch tiles:evict-first
                    attn_pdl._l2_prefetch, attn_pdl._evict_first = pf, bool(ef)
                    for r in b._decode_rows(attn, ceil, rng, 1, kv, 32, 8, 128, n_splits=n_splits,
                                            label=f"w{nw}{' apart' if apart else ''} pf{pf}{' ef' if ef else ''}",
                                            attn_pdl=attn_pdl)[int(pf > 0 or ef):]:
                        show(r)
        attn._tc_warps = attn_pdl._l2_prefetch = attn_pdl._evict_first = attn._merge_apart = None
    if "ahead" in which:  # decode_tc's in-loop L2 prefetch distance (PROBE_AHEAD tiles; -1: the rule), pdl, in turns
        aheads = [int(x) for x in os.environ.get("PROBE_AHEAD", "0,2").split(",")]
        cases = [(1, 32768, 32, 8, 128), (1, 65536, 32, 8, 128), (1, 131072, 32, 8, 128), (32, 4096, 32, 8, 128)]
        if os.environ.get("PROBE_DECODE"):
            cases = [tuple(int(v) for v in c.split("x")) for c in os.environ["PROBE_DECODE"].split(",")]
        for args in cases:
            _ahead_rows(b, attn_pdl, rng, ceil, args, aheads)
    if "wait" in which:  # split states merged by the first split's block polling (merge_wait) or the last to finish
        cases = [(1, 8192, 32, 8, 128), (1, 32768, 32, 8, 128), (1, 131072, 32, 8, 128)]
        if os.environ.get("PROBE_DECODE"):
            cases = [tuple(int(v) for v in c.split("x")) for c in os.environ["PROBE_DECODE"].split(",")]
        for args in cases:
            _wait_rows(b, attn_pdl, rng, ceil, args)
    if "layout" in which:  # does the distance between a layer's K and V pools change decode's read rate?
        for kv, nw, n_splits in [(32768, 8, 16), (131072, 4, 33)]:
            attn_pdl._tc_warps = nw
            for gap in (None, 0, 2048, 34 << 10, (1 << 20) + 6144):
                us = _kv_gap_us(attn_pdl, rng, kv, n_splits, gap)
                gbs = kv * 8 * 128 * 4 / us / 1e3
                print(f"layout KV{kv} w{nw} s{n_splits} pdl, V pool {'as allocated' if gap is None else f'{gap} B after K'}"
                      f": {us:8.2f} us {gbs:,.0f} GB/s {100 * gbs / ceil.copy_gbs:.0f}%", flush=True)
        attn_pdl._tc_warps = None
    if "prefill" in which:
        for bb, L, h, hk, d in [(4, 4096, 32, 32, 128), (4, 4096, 16, 16, 256)]:
            show(b._tc_rows("prefill paged f16", b._prefill_fn(attn, rng, bb, L, h, hk, d), bb, L, h, hk, d, True))
            if d == 128:
                show(b._tc_rows("varlen f16 (+lse)", b._varlen_fn(attn, rng, bb, L, h, hk, d), bb, L, h, hk, d, True))


def _rotating_case(b, rng, args):
    """A decode case (batch, kv_len, heads, KV heads, head_dim) over enough random f16 layers that rotating through
    them keeps K/V out of L2: (cache, slots, q, out, K/V bytes of a layer, layers)."""
    bb, kv_len, h, hk, d = args
    kv_bytes = bb * kv_len * hk * d * 4
    n_layers = max(1, min(16, -(-4 * b._L2_BYTES // kv_bytes)))
    cache = PagedKVCache(n_layers, bb * -(-kv_len // 16), 16, hk, d, max_seqs=bb)
    b._fill_pools(cache, rng)
    slots = [cache.add(kv_len) for _ in range(bb)]
    q = rng.standard_normal((bb, h, d), dtype=cupy.float32)
    return cache, slots, q, cupy.empty_like(q), kv_bytes, n_layers


def _ahead_rows(b, attn, rng, ceil, args, aheads, turns: int = 3) -> None:
    """Graph times (rotating layers) of one decode shape by in-loop L2 prefetch distance (-1: the rule), the
    distances timed in turns on one cache and the plan's own configuration."""
    bb, kv_len, h, hk, d = args
    cache, slots, q, out, kv_bytes, n_layers = _rotating_case(b, rng, args)
    plan = attn.plan_decode(cache, slots, h)
    times = {a: [] for a in aheads}
    for _ in range(turns):
        for a in aheads:
            attn._l2_ahead = None if a < 0 else a
            times[a].append(time_graph_us(_layer_steps(attn, plan, q, out, n_layers), n_inner=max(8, 2 * n_layers)))
    attn._l2_ahead = None
    for a in aheads:
        gbs = (kv_bytes + 2 * bb * h * d * 4) / min(times[a]) / 1e3
        print(f"ahead {a:2d} B{bb} KV{kv_len} {h}/{hk} D{d} w{plan.warps} s{plan.n_splits}{' pdl' if attn.pdl else ''}: "
              f"{' / '.join(f'{t:.2f}' for t in times[a])} us, {100 * gbs / ceil.copy_gbs:.1f}% of copy", flush=True)
    del cache


def _wait_rows(b, attn, rng, ceil, args, turns: int = 3) -> None:
    """Graph times (rotating layers) of one decode shape with its split states merged by the last block to finish
    (counted) and by the first split's block (merge_wait), the plan's own warps and splits or each PROBE_WAIT_CFG
    pair, with torch SDPA at the same shape, all timed in turns."""
    import torch
    import torch.nn.functional as F
    bb, kv_len, h, hk, d = args
    cache, slots, q, out, kv_bytes, n_layers = _rotating_case(b, rng, args)
    plans = {}
    cfgs = [tuple(int(v) for v in c.split(":")) for c in os.environ.get("PROBE_WAIT_CFG", "").split(",") if c]
    for nw, ns in cfgs or [(0, 0)]:  # warps:splits (PROBE_WAIT_CFG), or the plan's own
        attn._tc_warps = nw or None
        for wait in (False, True):
            attn._merge_wait = wait
            plans[f"{'wait' if wait else 'count'}{f' w{nw} s{ns}' if nw else ''}"] = attn.plan_decode(
                cache, slots, h, n_splits=ns or None)
    attn._merge_wait, attn._tc_warps = False, None
    tq = torch.randn(bb, h, 1, d, device="cuda", dtype=torch.float16)
    tkv = [(torch.randn(bb, hk, kv_len, d, device="cuda", dtype=torch.float16),
            torch.randn(bb, hk, kv_len, d, device="cuda", dtype=torch.float16)) for _ in range(n_layers)]
    j = itertools.count()

    def peer():
        kk, vv = tkv[next(j) % n_layers]
        F.scaled_dot_product_attention(tq, kk, vv, enable_gqa=hk != h)
    times = {k: [] for k in (*plans, "sdpa")}
    for _ in range(turns):
        for k, plan in plans.items():
            times[k].append(time_graph_us(_layer_steps(attn, plan, q, out, n_layers), n_inner=max(8, 2 * n_layers)))
        times["sdpa"].append(b._torch_graph_us(peer, max(8, 2 * n_layers)))
    tkv.clear()  # the peer's K/V freed before the next shape
    del cache
    for k, ts in times.items():
        p = plans.get(k)
        gbs = (kv_bytes + 2 * bb * h * d * 4) / min(ts) / 1e3
        cfg = f"w{p.warps} s{p.n_splits} wait={p.merge_wait}" if p else ""
        print(f"{k:14s} B{bb} KV{kv_len} {h}/{hk} D{d} {cfg}: "
              f"{' / '.join(f'{t:.2f}' for t in ts)} us, {100 * gbs / ceil.copy_gbs:.1f}% of copy, "
              f"{min(times['sdpa']) / min(ts):.3f}x SDPA", flush=True)


def _kv_gap_us(attn, rng, kv_len: int, n_splits: int, gap) -> float:
    """Graph time of B1 32/8 D128 decode steps over rotating layers whose V pool starts `gap` bytes after the
    end of the K pool in one allocation (None: the cache's own separate pools)."""
    n_layers = max(1, min(16, -(-4 * (50 << 20) // (kv_len * 8 * 128 * 4))))
    cache, s, q, out = _b1_decode_case(rng, kv_len, n_layers)
    if gap is not None:
        n = cache.k_pools[0].size
        for layer in range(n_layers):
            buf = cupy.empty(2 * n + gap // 2, cupy.float16)
            k, v = buf[:n].reshape(cache.k_pools[layer].shape), buf[n + gap // 2:].reshape(cache.v_pools[layer].shape)
            k[...] = cache.k_pools[layer]
            v[...] = cache.v_pools[layer]
            cache.k_pools[layer], cache.v_pools[layer] = k, v
    plan = attn.plan_decode(cache, [s], 32, n_splits=n_splits)
    return time_graph_us(_layer_steps(attn, plan, q, out, n_layers), n_inner=max(8, 2 * n_layers))


def fixed_cost() -> None:
    """Where the fixed part of a B1 32/8 D128 decode goes: graph time per launch over KV lengths, with K/V
    rotating over layers (DRAM) or on one layer (L2-resident up to ~8k), by warps and splits."""
    attn = AttentionDispatch()
    rng = cupy.random.default_rng(1)
    for kv_len in (64, 1024, 8192):
        n_layers = 16
        cache, s, q, out = _b1_decode_case(rng, kv_len, n_layers)
        for nw in (4, 8):
            attn._tc_warps = nw
            for n_splits in (1, 2, 16):
                if kv_len < 32 * n_splits:
                    continue
                plan = attn.plan_decode(cache, [s], 32, n_splits=n_splits)
                t_rot = time_graph_us(_layer_steps(attn, plan, q, out, n_layers), n_inner=32)
                t_one = time_graph_us(lambda: attn.flash_attn_decode(plan, 0, q, out), n_inner=32)
                print(f"KV{kv_len} w{nw} s{n_splits}: rotating {t_rot:.2f} us, one layer {t_one:.2f} us", flush=True)
        attn._tc_warps = None
        del cache
    v = cupy.zeros((1, 1, 1, 32), cupy.float32)
    sl = cupy.zeros((1, 1, 1), cupy.float32)
    o = cupy.zeros((1, 1, 32), cupy.float32)
    print(f"tiny merge launch: {time_graph_us(lambda: attn.merge_states(v, sl, o), n_inner=64):.2f} us")


def main():
    if os.environ.get("PROBE_FIXED"):
        return fixed_cost()
    if os.environ.get("PROBE_ROWS"):
        return target_rows(os.environ["PROBE_ROWS"])
    if os.environ.get("PROBE_NCU_PEER"):
        return ncu_peer()
    if os.environ.get("PROBE_NCU_PREFILL"):
        return ncu_prefill()
    if os.environ.get("PROBE_NCU_SPLITS"):
        return ncu_target(int(os.environ["PROBE_NCU_SPLITS"]))
    attn = AttentionDispatch()
    rng = cupy.random.default_rng(0)
    for kv_len in (8192, 64):
        n_layers = 8
        cache, s, q, out = _b1_decode_case(rng, kv_len, n_layers)
        for n_splits in (1, 8, 16, 32, 64):
            if kv_len < 64 * n_splits and n_splits > 1:
                continue
            plan = attn.plan_decode(cache, [s], 32, n_splits=n_splits)
            full = time_graph_us(_layer_steps(attn, plan, q, out, n_layers), n_inner=32)
            merge = None
            if n_splits > 1:
                merge = time_graph_us(lambda: attn.merge_states(plan.o_part, plan.lse_part, out), n_inner=32)
            print(f"KV{kv_len} splits={n_splits}: decode+merge {full:.2f} us, merge alone "
                  f"{merge if merge is None else round(merge, 2)} us", flush=True)
    # empty-ish launch: merge of one state, one head
    v = cupy.zeros((1, 1, 1, 32), cupy.float32)
    sl = cupy.zeros((1, 1, 1), cupy.float32)
    o = cupy.zeros((1, 1, 32), cupy.float32)
    print(f"tiny merge launch: {time_graph_us(lambda: attn.merge_states(v, sl, o), n_inner=64):.2f} us")


if __name__ == "__main__":
    main()
