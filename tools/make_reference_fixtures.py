#!/usr/bin/env python
"""Generate golden fixtures from the reference (jax-tpu-embedding==0.1.0).

Dev tool only. Run with the peer venv, never imported by tilecore:

    /work/peer-venv/bin/python tools/make_reference_fixtures.py [--out DIR] [--only CASE ...]

For each case writes ``<out>/<case>.json`` (specs, stacking result, stats) and
``<out>/<case>.npz`` (inputs per feature, reference outputs per stack with
``covered``/``filler`` masks; uncovered entries are zeroed so files are
deterministic).

NPZ keys:
  in/<feature>/values      int32   concatenated ids (process-local rows)
  in/<feature>/row_splits  int64   len rows+1
  in/<feature>/weights     float32 (only when the case is weighted)
  out/<stack>/row_pointers int32   flat (has_leading_dimension=False)
  out/<stack>/embedding_ids, sample_ids int32, gains float32 (flat)
  out/<stack>/covered      bool    entries inside [roundup8(end[p-1]), end[p])
  out/<stack>/filler       bool    alignment filler [end[p], roundup8(end[p]))
                                   (reference writes eid=sid=2^31-1, gain=NaN
                                   there; zeroed in the saved arrays)
  num_minibatches          as returned (int64 for dense/ragged path, int32 COO)

Non-dropping cases are first probed with allow_id_dropping=True; the
generator refuses to write a case whose stats would exceed its limits (the
reference would abort the process).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zlib

import numpy as np

from jax_tpu_embedding.sparsecore.lib.nn import embedding
from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec
from jax_tpu_embedding.sparsecore.lib.nn import table_stacking
from jax_tpu_embedding.sparsecore.utils import utils as _ref_utils

# The reference Python layer only accepts num_sc_per_device in {2, 4}; the C++
# core accepts 1 too. Register a fake device kind so 1x1 topologies can run.
_ref_utils.NUM_SC_PER_DEVICE_MAP.setdefault("fixture-fake-1sc", 1)

DEFAULT_ACT_LIMIT = 2048 * 1024
INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------
# Input generation helpers
# --------------------------------------------------------------------------


def zipf_ids(rng, n, vocab, a=1.3, hot_frac=0.7):
  z = (rng.zipf(a, n) - 1) % vocab
  u = rng.integers(0, vocab, n)
  return np.where(rng.random(n) < hot_frac, z, u).astype(np.int32)


def ragged_lengths(rng, rows, max_len, p_empty=0.15):
  lens = rng.integers(1, max_len + 1, rows)
  lens[rng.random(rows) < p_empty] = 0
  return lens


def make_weights(rng, n, kind):
  if kind == "random":
    return rng.uniform(0.25, 2.0, n).astype(np.float32)
  if kind == "ones":
    return np.ones(n, np.float32)
  raise ValueError(kind)


# --------------------------------------------------------------------------
# Case definitions
# --------------------------------------------------------------------------
# A case dict:
#   name, topology (G, L, S), tables: list of dicts (name, vocab, dim, combiner,
#   optimizer, max_ids, max_unique, suggested), features: list of
#   (name, table, global_batch, width), stacking, act_limit, allow_id_dropping,
#   input_format, weighted, inputs: optional explicit {feature: list of rows}
#   (and weights), gen: kwargs for random generation.


def T(name, vocab, dim, combiner="sum", optimizer="sgd", max_ids=256,
      max_unique=256, suggested=None):
  return dict(name=name, vocab=vocab, dim=dim, combiner=combiner,
              optimizer=optimizer, max_ids=max_ids, max_unique=max_unique,
              suggested=suggested)


def F(name, table, batch, width):
  return (name, table, batch, width)


CASES = []


def case(**kw):
  kw.setdefault("stacking", "none")
  kw.setdefault("act_limit", None)
  kw.setdefault("allow_id_dropping", False)
  kw.setdefault("input_format", "ragged")
  kw.setdefault("weighted", False)
  kw.setdefault("weight_kind", "random")
  kw.setdefault("inputs", None)
  kw.setdefault("gen", {})
  kw.setdefault("tight", False)
  kw.setdefault("enable_minibatching", False)
  CASES.append(kw)


# 1. REFERENCE.md §2 worked example.
case(name="worked_example", topology=(1, 1, 2),
     tables=[T("t", 32, 8, max_ids=64, max_unique=64)],
     features=[F("f", "t", 2, 10)],
     inputs={"f": [[0, 0, 0, 2, 4, 1], [1, 1, 1, 3, 3, 5, 5, 7, 7, 0]]})

# 2. REFERENCE.md §2 dropping example (N=2: even ids -> partition 0).
case(name="dropping_example", topology=(1, 1, 2),
     tables=[T("t", 32, 8, max_ids=3, max_unique=2)],
     features=[F("f", "t", 4, 4)], allow_id_dropping=True,
     inputs={"f": [[6, 2, 4], [2, 0, 4, 4], [1], [3]]})

# 3. 1x1 (S=1 via the C++ core), dense sum, tight limits (== observed max).
case(name="t1x1_dense_sum_tight", topology=(1, 1, 1),
     tables=[T("t", 100, 8)], features=[F("f", "t", 16, 4)],
     input_format="dense", tight=True)

# 4. 1x2 ragged mean with empty samples, unit weights.
case(name="t1x2_ragged_mean_empty", topology=(1, 1, 2),
     tables=[T("t", 50, 16, combiner="mean")], features=[F("f", "t", 16, 6)],
     gen=dict(p_empty=0.3))

# 5. 1x4 ragged sqrtn with random weights (duplicates with different weights).
case(name="t1x4_ragged_sqrtn_weighted", topology=(1, 1, 4),
     tables=[T("t", 64, 8, combiner="sqrtn")], features=[F("f", "t", 32, 8)],
     weighted=True, gen=dict(a=1.15, hot_frac=0.9))

# 6. 1x2 dense weighted sum / mean / sqrtn, three unstacked tables, heavy dups.
case(name="t1x2_dense_weighted_combiners", topology=(1, 1, 2),
     tables=[T("ts", 40, 8, combiner="sum"), T("tm", 40, 8, combiner="mean"),
             T("tq", 40, 8, combiner="sqrtn")],
     features=[F("fs", "ts", 8, 6), F("fm", "tm", 8, 6), F("fq", "tq", 8, 6)],
     input_format="dense", weighted=True, gen=dict(a=1.1, hot_frac=0.95))

# 7. 2x4, local 2 (single process holding 2 devices), dense weighted mean.
case(name="t2x4_l2_dense_mean_weighted", topology=(2, 2, 4),
     tables=[T("ta", 300, 16, combiner="mean"),
             T("tb", 1000, 8, combiner="mean", optimizer="adagrad")],
     features=[F("fa", "ta", 32, 3), F("fb", "tb", 64, 2)],
     input_format="dense", weighted=True)

# 8. 4x2, local 4, ragged sum, feature stacking: 3 features share a table,
#    list order (f_c, f_a, f_b) differs from name order.
case(name="t4x2_l4_ragged_featstack", topology=(4, 4, 2),
     tables=[T("shared", 500, 8), T("other", 70, 24, combiner="sqrtn")],
     features=[F("f_c", "shared", 16, 5), F("g", "other", 32, 4),
               F("f_a", "shared", 32, 3), F("f_b", "shared", 16, 6)])

# 9. Multi-host simulation: G=4, this process holds L=2 devices (half the rows).
case(name="t4x2_l2_multihost_ragged", topology=(4, 2, 2),
     tables=[T("t", 200, 8, combiner="mean"), T("u", 90, 8)],
     features=[F("fx", "t", 32, 6), F("fy", "u", 16, 3), F("fw", "t", 16, 2)])

# 10. Multi-host simulation with auto stacking, weighted sum.
case(name="t8x2_l2_multihost_auto_weighted", topology=(8, 2, 2),
     tables=[T("a", 300, 8), T("b", 150, 8), T("c", 77, 16)],
     features=[F("fb", "b", 32, 3), F("fa", "a", 64, 4), F("fc", "c", 32, 2)],
     stacking="auto", weighted=True)

# 11. Sparse COO input, 1x2, mean combiner (unit weights), empty rows.
case(name="coo_t1x2_mean", topology=(1, 1, 2),
     tables=[T("t", 64, 8, combiner="mean")], features=[F("f", "t", 16, 7)],
     input_format="sparse_coo", gen=dict(p_empty=0.25))

# 12. Sparse COO input, 2x4 local 2, sqrtn, feature stacking.
case(name="coo_t2x4_l2_sqrtn_featstack", topology=(2, 2, 4),
     tables=[T("t", 400, 16, combiner="sqrtn")],
     features=[F("zeta", "t", 32, 5), F("alpha", "t", 16, 4)],
     input_format="sparse_coo")

# 13. Auto stacking, mixed dims 12/10/16/32/8 + one adagrad and one mean table;
#     features of different tables interleave in the list; two features share a
#     table with name order != list order.
case(name="auto_mixed_dims", topology=(2, 2, 4),
     tables=[T("tab_d12", 100, 12), T("tab_d10", 250, 10),
             T("tab_d16", 64, 16, optimizer="adagrad"), T("tab_d32", 500, 32),
             T("tab_d8", 40, 8, combiner="mean"), T("tab_e16", 33, 16)],
     features=[F("z_first", "tab_d10", 16, 3), F("m_a", "tab_d12", 32, 2),
               F("b_mid", "tab_d10", 16, 4), F("q", "tab_d32", 16, 2),
               F("k", "tab_d16", 16, 3), F("a_last", "tab_d8", 16, 5),
               F("e", "tab_e16", 16, 2)],
     stacking="auto")

# 14. Auto stacking with a small activation-memory limit (groups split
#     first-fit, some single-table stacks).
case(name="auto_activation_split", topology=(1, 1, 4),
     tables=[T("w1", 64, 16), T("w2", 80, 16), T("w3", 48, 14),
             T("w4", 96, 16, max_ids=40, max_unique=30), T("w5", 32, 32)],
     features=[F("x3", "w3", 16, 3), F("x1", "w1", 32, 2), F("x2", "w2", 16, 4),
               F("x4", "w4", 16, 3), F("x5", "w5", 16, 2)],
     stacking="auto", act_limit=640)

# 15. Auto stacking where every group is a single table; feature sharing inside
#     a single-table auto stack (row offsets in list order) + suggested COO
#     size on the table (auto stacking drops it).
case(name="auto_single_table_groups", topology=(1, 1, 2),
     tables=[T("solo_a", 60, 8, max_ids=100, max_unique=100, suggested=200),
             T("solo_b", 30, 24, combiner="mean")],
     features=[F("s_z", "solo_a", 8, 3), F("s_b", "solo_b", 8, 3),
               F("s_a", "solo_a", 8, 2)],
     stacking="auto")

# 16. Explicit stack_tables groups; group order differs from appearance order.
case(name="explicit_groups", topology=(2, 2, 2),
     tables=[T("ga", 100, 8), T("gb", 200, 8), T("gc", 60, 8),
             T("gd", 50, 16)],
     features=[F("fa", "ga", 16, 3), F("fb", "gb", 16, 2), F("fc", "gc", 16, 4),
               F("fd", "gd", 16, 2), F("fa2", "ga", 8, 2)],
     stacking={"groups": [["gc", "ga"], ["gd"]]})

# 17. Long table names -> short stack name with hash.
case(name="auto_long_names", topology=(1, 1, 2),
     tables=[T("a_really_long_embedding_table_name_number_one", 40, 8),
             T("another_really_long_embedding_table_name_number_two", 56, 8)],
     features=[F("f1", "a_really_long_embedding_table_name_number_one", 8, 3),
               F("f2", "another_really_long_embedding_table_name_number_two",
                 8, 3)],
     stacking="auto")

# 18. Dropping with small limits, 2x4 local 2, sum, skewed ids.
case(name="drop_t2x4_l2_sum", topology=(2, 2, 4),
     tables=[T("t", 256, 8, max_ids=4, max_unique=3)],
     features=[F("f", "t", 64, 8)], allow_id_dropping=True,
     gen=dict(a=1.2, hot_frac=0.8))

# 19. Dropping with weighted mean + feature stacking, 1x2.
case(name="drop_t1x2_weighted_mean_featstack", topology=(1, 1, 2),
     tables=[T("t", 40, 8, combiner="mean", max_ids=5, max_unique=2)],
     features=[F("fy", "t", 8, 6), F("fx", "t", 8, 4)],
     allow_id_dropping=True, weighted=True, gen=dict(a=1.2, hot_frac=0.8))

# 20. Dropping in an auto-stacked multi-table stack (limits 256 -> use many ids).
case(name="drop_auto_stack_dense", topology=(1, 1, 2),
     tables=[T("p", 16, 8, max_ids=2, max_unique=2), T("q", 16, 8)],
     features=[F("fp", "p", 64, 12), F("fq", "q", 64, 12)],
     input_format="dense", allow_id_dropping=True, stacking="auto",
     gen=dict(a=1.05, hot_frac=0.98))

# 21. suggested_coo_buffer_size_per_device set (not a multiple of 8*S), no
#     overflow.
case(name="suggested_coo_fits", topology=(1, 1, 4),
     tables=[T("t", 128, 8, max_ids=64, max_unique=64, suggested=301)],
     features=[F("f", "t", 16, 4)], gen=dict(a=2.0, hot_frac=0.3))

# 22. suggested_coo_buffer_size_per_device too small: silent overflow drop.
case(name="suggested_coo_overflow", topology=(1, 1, 2),
     tables=[T("t", 128, 8, max_ids=64, max_unique=64, suggested=20)],
     features=[F("f", "t", 16, 6)], gen=dict(a=1.5, hot_frac=0.5))

# 23. Mean combiner with weights that sum to zero in some rows (inf/nan gains).
case(name="mean_zero_weight_sum", topology=(1, 1, 2),
     tables=[T("t", 32, 8, combiner="mean")], features=[F("f", "t", 4, 4)],
     input_format="ragged", weighted=True,
     inputs={"f": [[1, 2], [3, 3, 5], [7], [9, 11]]},
     weights={"f": [[1.0, -1.0], [2.0, -1.0, -1.0], [0.0], [0.5, 0.25]]})


# Minibatching cases (enable_minibatching=True) are written to
# <out>/minibatching/: their layout differs (REFERENCE.md §3), so the plain
# fixture test does not read them.

# 24. Forced minibatching: small limits, 1x2, ragged sum.
case(name="mb_t1x2_forced", topology=(1, 1, 2),
     tables=[T("t", 256, 8, max_ids=8, max_unique=8)], features=[F("f", "t", 16, 8)],
     enable_minibatching=True)

# 25. Minibatching enabled, limits never exceeded: M=1 with the minibatching layout.
case(name="mb_t1x4_m1", topology=(1, 1, 4),
     tables=[T("t", 300, 8, combiner="mean", max_ids=64, max_unique=64)],
     features=[F("f", "t", 32, 6)], enable_minibatching=True)

# 26. Forced, 2 local devices x 4 SCs, weighted mean, skewed ids.
case(name="mb_t2x4_l2_weighted_mean", topology=(2, 2, 4),
     tables=[T("t", 4000, 8, combiner="mean", max_ids=10, max_unique=9)],
     features=[F("f", "t", 128, 8)], weighted=True, enable_minibatching=True,
     gen=dict(a=1.3, hot_frac=0.1))

# 27. Forced in one stack only: the split applies to every stack (two stacks,
#     feature stacking in one of them).
case(name="mb_two_stacks_featstack", topology=(1, 1, 2),
     tables=[T("hot", 400, 8, max_ids=10, max_unique=10),
             T("cold", 64, 16, combiner="sqrtn")],
     features=[F("h2", "hot", 32, 6), F("c", "cold", 16, 3), F("h1", "hot", 16, 4)],
     enable_minibatching=True)

# 28. One hot row alone exceeds max_ids: its bucket cannot be split, so the
#     excess is dropped (allow_id_dropping) per (partition, minibatch).
case(name="mb_drop_single_bucket", topology=(1, 1, 2),
     tables=[T("t", 128, 8, max_ids=3, max_unique=3)], features=[F("f", "t", 32, 5)],
     input_format="dense", allow_id_dropping=True, enable_minibatching=True,
     gen=dict(a=1.05, hot_frac=0.9))


# --------------------------------------------------------------------------
# Building specs and inputs
# --------------------------------------------------------------------------


def make_optimizer(kind):
  if kind == "sgd":
    return embedding_spec.SGDOptimizerSpec()
  if kind == "adagrad":
    return embedding_spec.AdagradOptimizerSpec()
  raise ValueError(kind)


def build_specs(c, limits_override=None):
  """Returns feature specs (list) with stacking prepared."""
  G, L, S = c["topology"]
  tables = {}
  for t in c["tables"]:
    max_ids, max_unique = t["max_ids"], t["max_unique"]
    if limits_override and t["name"] in limits_override:
      max_ids, max_unique = limits_override[t["name"]]
    tables[t["name"]] = embedding_spec.TableSpec(
        name=t["name"], vocabulary_size=t["vocab"], embedding_dim=t["dim"],
        initializer=lambda *a, **k: None,
        optimizer=make_optimizer(t["optimizer"]), combiner=t["combiner"],
        max_ids_per_partition=max_ids,
        max_unique_ids_per_partition=max_unique,
        suggested_coo_buffer_size_per_device=t["suggested"])
  feats = []
  for (fname, tname, batch, width) in c["features"]:
    feats.append(embedding_spec.FeatureSpec(
        name=fname, table_spec=tables[tname], input_shape=[batch, width],
        output_shape=[batch, tables[tname].embedding_dim]))
  st = c["stacking"]
  if st == "auto":
    kw = {}
    if c["act_limit"] is not None:
      kw["activation_mem_bytes_limit"] = c["act_limit"]
    # embedding.auto_stack_tables in 0.1.0 does not forward
    # activation_mem_bytes_limit; call table_stacking directly (same defaults).
    table_stacking.auto_stack_tables(
        feats, global_device_count=G, num_sc_per_device=S, **kw)
  elif isinstance(st, dict):
    for group in st["groups"]:
      table_stacking.stack_tables(feats, group, global_device_count=G,
                                  num_sc_per_device=S)
  else:
    assert st == "none", st
  embedding.prepare_feature_specs_for_training(
      feats, global_device_count=G, num_sc_per_device=S)
  return feats


def build_inputs(c):
  """Returns {feature: (values int32, row_splits int64, weights|None)} local."""
  G, L, S = c["topology"]
  rng = np.random.default_rng(zlib.crc32(c["name"].encode()))
  gen = c["gen"]
  out = {}
  tabs = {t["name"]: t for t in c["tables"]}
  for (fname, tname, batch, width) in c["features"]:
    rows = batch * L // G
    assert rows * G == batch * L
    if c["inputs"] is not None:
      rl = c["inputs"][fname]
      assert len(rl) == rows, (fname, len(rl), rows)
      lens = np.array([len(r) for r in rl], np.int64)
      values = np.array([v for r in rl for v in r], np.int32)
      if c["weighted"]:
        w = c["weights"][fname]
        weights = np.array([x for r in w for x in r], np.float32)
        assert len(weights) == len(values)
      else:
        weights = None
    else:
      if c["input_format"] == "dense":
        lens = np.full(rows, width, np.int64)
      else:
        lens = ragged_lengths(rng, rows, width, gen.get("p_empty", 0.15))
      n = int(lens.sum())
      values = zipf_ids(rng, n, tabs[tname]["vocab"], gen.get("a", 1.3),
                        gen.get("hot_frac", 0.7))
      weights = (make_weights(rng, n, c["weight_kind"]) if c["weighted"]
                 else None)
    row_splits = np.zeros(rows + 1, np.int64)
    row_splits[1:] = np.cumsum(lens)
    out[fname] = (values, row_splits, weights)
  return out


def to_reference_args(c, inputs):
  fmt = c["input_format"]
  names = [f[0] for f in c["features"]]
  if fmt == "dense":
    feats, wts = [], []
    for n in names:
      v, rs, w = inputs[n]
      rows = len(rs) - 1
      feats.append(v.reshape(rows, -1))
      wts.append(None if w is None else w.reshape(rows, -1))
    return feats, (wts if c["weighted"] else None)
  if fmt == "ragged":
    feats, wts = [], []
    for n in names:
      v, rs, w = inputs[n]
      rows = len(rs) - 1
      fa = np.empty(rows, dtype=object)
      wa = np.empty(rows, dtype=object)
      for i in range(rows):
        fa[i] = v[rs[i]:rs[i + 1]]
        if w is not None:
          wa[i] = w[rs[i]:rs[i + 1]]
      feats.append(fa)
      wts.append(wa)
    return feats, (wts if c["weighted"] else None)
  if fmt == "sparse_coo":
    assert not c["weighted"]
    idx, vals, shapes = [], [], []
    for (fname, _, _, width) in c["features"]:
      v, rs, _ = inputs[fname]
      rows = len(rs) - 1
      lens = np.diff(rs)
      r = np.repeat(np.arange(rows, dtype=np.int64), lens)
      col = np.arange(len(v), dtype=np.int64) - np.repeat(rs[:-1], lens)
      idx.append(np.stack([r, col], axis=1).astype(np.int64).reshape(-1, 2))
      vals.append(v.astype(np.int32))
      shapes.append(np.array([rows, width], np.int64))
    return (idx, vals, shapes), None
  raise ValueError(fmt)


def run_reference(c, feats_specs, inputs, allow_id_dropping):
  G, L, S = c["topology"]
  args, wts = to_reference_args(c, inputs)
  kw = dict(local_device_count=L, global_device_count=G, num_sc_per_device=S,
            allow_id_dropping=allow_id_dropping, has_leading_dimension=False,
            enable_minibatching=c["enable_minibatching"])
  if c["input_format"] == "sparse_coo":
    idx, vals, shapes = args
    return embedding.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
        idx, vals, shapes, feats_specs, **kw)
  return embedding.preprocess_sparse_dense_matmul_input(
      args, wts, feats_specs, **kw)


# --------------------------------------------------------------------------
# Output processing
# --------------------------------------------------------------------------


def roundup8(x):
  return (x + 7) // 8 * 8


def masks_for_stack(rp, n_coo, G, L, S):
  N = G * S
  rp_dev = len(rp) // L
  coo_dev = n_coo // L
  assert rp_dev * L == len(rp) and coo_dev * L == n_coo
  rp_sc = rp_dev // S
  slot = coo_dev // S
  assert rp_sc == max(N, 8), (rp_sc, N)
  covered = np.zeros(n_coo, bool)
  filler = np.zeros(n_coo, bool)
  for d in range(L):
    for s in range(S):
      blk = rp[(d * S + s) * rp_sc:(d * S + s + 1) * rp_sc]
      base = (d * S + s) * slot
      prev = 0
      for p in range(N):
        start, end = roundup8(prev), int(blk[p])
        assert start <= end <= slot, (d, s, p, start, end, slot)
        covered[base + start:base + end] = True
        filler[base + end:base + min(roundup8(end), slot)] = True
        prev = end
      # Unused pointer slots hold the last aligned offset.
      for p in range(N, rp_sc):
        assert int(blk[p]) == min(roundup8(prev), slot), (blk, prev)
  return covered, filler


def masks_for_minibatched_stack(rp, n_coo, G, L, S, M):
  """Covered/filler masks of the minibatching layout (absolute pointers).

  Per device, row-pointer block k = sc*M + mb holds max(N, 8) absolute
  exclusive ends; segments follow each other, each partition 8-aligned.
  Blocks k >= S*M and the buffer tail are left uninitialised by the reference.
  """
  N = G * S
  B = max(N, 8)
  rp_dev = len(rp) // L
  coo_dev = n_coo // L
  assert rp_dev == B * 64 * S, (rp_dev, B, S)
  covered = np.zeros(n_coo, bool)
  filler = np.zeros(n_coo, bool)
  used = np.zeros(len(rp), bool)
  for d in range(L):
    prev = 0
    for k in range(S * M):
      blk = rp[d * rp_dev + k * B:d * rp_dev + (k + 1) * B]
      used[d * rp_dev + k * B:d * rp_dev + (k + 1) * B] = True
      for p in range(N):
        start, end = roundup8(prev), int(blk[p])
        assert start <= end <= coo_dev, (d, k, p, start, end, coo_dev)
        covered[d * coo_dev + start:d * coo_dev + end] = True
        filler[d * coo_dev + end:d * coo_dev + min(roundup8(end), coo_dev)] = True
        prev = end
      for p in range(N, B):
        assert int(blk[p]) == min(roundup8(prev), coo_dev), (blk, prev)
  return covered, filler, used


def spec_json(feats_specs):
  tables, features, stacks = {}, {}, {}
  for f in feats_specs:
    t = f.table_spec
    s = t.setting_in_stack
    tables[t.name] = dict(stack_name=s.stack_name,
                          padded_vocab_size=int(s.padded_vocab_size),
                          padded_embedding_dim=int(s.padded_embedding_dim),
                          row_offset_in_shard=int(s.row_offset_in_shard),
                          shard_rotation=int(s.shard_rotation))
    it = f.id_transformation
    features[f.name] = dict(row_offset=int(it.row_offset),
                            col_offset=int(it.col_offset),
                            col_shift=int(it.col_shift))
    st = t.stacked_table_spec
    stacks[st.stack_name] = dict(
        stack_name=st.stack_name, stack_vocab_size=int(st.stack_vocab_size),
        stack_embedding_dim=int(st.stack_embedding_dim),
        total_sample_count=int(st.total_sample_count),
        max_ids_per_partition=int(st.max_ids_per_partition),
        max_unique_ids_per_partition=int(st.max_unique_ids_per_partition),
        suggested_coo_buffer_size_per_device=(
            None if st.suggested_coo_buffer_size_per_device is None
            else int(st.suggested_coo_buffer_size_per_device)),
        optimizer=type(st.optimizer).__name__, combiner=st.combiner)
  return dict(tables=tables, features=features, stacks=stacks)


def check_within_limits(c, feats_specs, stats):
  lim = {f.table_spec.stacked_table_spec.stack_name:
         (f.table_spec.stacked_table_spec.max_ids_per_partition,
          f.table_spec.stacked_table_spec.max_unique_ids_per_partition)
         for f in feats_specs}
  for s, (mi, mu) in lim.items():
    a = int(np.max(stats.max_ids_per_partition[s]))
    b = int(np.max(stats.max_unique_ids_per_partition[s]))
    if a > mi or b > mu:
      raise SystemExit(f"case {c['name']}: stack {s} stats ({a},{b}) exceed "
                       f"limits ({mi},{mu}); the reference would abort")


def make_case(c, outdir):
  G, L, S = c["topology"]
  inputs = build_inputs(c)
  limits_override = None
  if c["tight"]:
    # Calibrate: table limits = observed maxima (single-table stacks only).
    probe_specs = build_specs(
        c, {t["name"]: (4096, 4096) for t in c["tables"]})
    _, pst = run_reference(c, probe_specs, inputs, True)
    limits_override = {}
    for f in probe_specs:
      sname = f.table_spec.stacked_table_spec.stack_name
      limits_override[f.table_spec.name] = (
          max(1, int(np.max(pst.max_ids_per_partition[sname]))),
          max(1, int(np.max(pst.max_unique_ids_per_partition[sname]))))
    for t in c["tables"]:
      t["max_ids"], t["max_unique"] = limits_override[t["name"]]
  if not c["allow_id_dropping"]:
    probe_specs = build_specs(c, limits_override)
    _, pst = run_reference(c, probe_specs, inputs, True)
    if c["enable_minibatching"]:
      # Minibatching aborts only when one bucket alone exceeds a limit, which
      # the dropping probe reveals as drops.
      if any(int(v) for v in pst.id_drop_counters.values()):
        raise SystemExit(f"case {c['name']}: a bucket exceeds the limits; the "
                         "reference would abort")
    else:
      check_within_limits(c, probe_specs, pst)
  specs = build_specs(c, limits_override)
  pin, stats = run_reference(c, specs, inputs, c["allow_id_dropping"])
  m = pin.sparse_dense_matmul_input

  arrays = {}
  for (fname, _, _, _) in c["features"]:
    v, rs, w = inputs[fname]
    arrays[f"in/{fname}/values"] = v.astype(np.int32)
    arrays[f"in/{fname}/row_splits"] = rs.astype(np.int64)
    if c["weighted"]:
      arrays[f"in/{fname}/weights"] = w.astype(np.float32)
  # The reference returns stacks in (per-process randomised) hash-map order;
  # record them sorted so the files are deterministic.
  stack_order = sorted(m.lhs_row_pointers.keys())
  num_mb = int(np.asarray(pin.num_minibatches).ravel()[0])
  sizes = {}
  for s in stack_order:
    rp = np.asarray(m.lhs_row_pointers[s])
    eid = np.asarray(m.lhs_embedding_ids[s]).copy()
    sid = np.asarray(m.lhs_sample_ids[s]).copy()
    gn = np.asarray(m.lhs_gains[s]).copy()
    assert rp.dtype == np.int32 and eid.dtype == np.int32
    assert sid.dtype == np.int32 and gn.dtype == np.float32
    assert eid.shape == sid.shape == gn.shape and rp.ndim == 1
    if c["enable_minibatching"]:
      covered, filler, used = masks_for_minibatched_stack(rp, eid.size, G, L, S,
                                                          num_mb)
      rp = np.where(used, rp, 0).astype(np.int32)
    else:
      covered, filler = masks_for_stack(rp, eid.size, G, L, S)
    # Sanity: filler really is INT32_MAX / NaN.
    assert np.all(eid[filler] == INT32_MAX) and np.all(sid[filler] == INT32_MAX)
    assert np.all(np.isnan(gn[filler]))
    eid[~covered] = 0
    sid[~covered] = 0
    gn[~covered] = 0
    arrays[f"out/{s}/row_pointers"] = rp
    arrays[f"out/{s}/embedding_ids"] = eid
    arrays[f"out/{s}/sample_ids"] = sid
    arrays[f"out/{s}/gains"] = gn
    arrays[f"out/{s}/covered"] = covered
    arrays[f"out/{s}/filler"] = filler
    sizes[s] = dict(coo_size_per_device=int(eid.size // L),
                    row_pointers_size_per_device=int(rp.size // L))
  arrays["num_minibatches"] = np.asarray(pin.num_minibatches)

  tabs = []
  for t in c["tables"]:
    tabs.append(dict(name=t["name"], vocab_size=t["vocab"],
                     embedding_dim=t["dim"], combiner=t["combiner"],
                     optimizer=t["optimizer"],
                     max_ids_per_partition=t["max_ids"],
                     max_unique_ids_per_partition=t["max_unique"],
                     suggested_coo_buffer_size_per_device=t["suggested"]))
  feats = [dict(name=fn, table=tn, input_shape=[b, w],
                output_shape=[b, next(t["dim"] for t in c["tables"]
                                      if t["name"] == tn)])
           for (fn, tn, b, w) in c["features"]]
  stats_json = {}
  for s in stack_order:
    stats_json[s] = dict(
        max_ids_per_partition=[int(x) for x in
                               np.asarray(stats.max_ids_per_partition[s])],
        max_unique_ids_per_partition=[
            int(x) for x in np.asarray(stats.max_unique_ids_per_partition[s])],
        required_buffer_size_per_sc=[
            int(x) for x in np.asarray(stats.required_buffer_size_per_sc[s])],
        id_drop_counters=int(stats.id_drop_counters[s]))
  meta = dict(
      name=c["name"],
      reference="jax-tpu-embedding==0.1.0",
      topology=dict(global_devices=G, local_devices=L, sc_per_device=S),
      tables=tabs, features=feats, stacking=c["stacking"],
      activation_mem_bytes_limit=c["act_limit"],
      allow_id_dropping=c["allow_id_dropping"],
      input_format=c["input_format"], weighted=c["weighted"],
      enable_minibatching=c["enable_minibatching"], num_minibatches=num_mb,
      result_stacking=spec_json(specs),
      stack_order=stack_order,
      buffer_sizes=sizes,
      num_minibatches_dtype=str(arrays["num_minibatches"].dtype),
      stats=stats_json)
  if c["enable_minibatching"]:
    outdir = os.path.join(outdir, "minibatching")
    os.makedirs(outdir, exist_ok=True)
  np.savez_compressed(os.path.join(outdir, c["name"] + ".npz"), **arrays)
  with open(os.path.join(outdir, c["name"] + ".json"), "w") as fh:
    json.dump(meta, fh, indent=1, sort_keys=False)
    fh.write("\n")
  drops = {s: v["id_drop_counters"] for s, v in stats_json.items()}
  print(f"{c['name']}: stacks={stack_order} drops={drops} minibatches={num_mb}")


def main():
  ap = argparse.ArgumentParser()
  here = os.path.dirname(os.path.abspath(__file__))
  ap.add_argument("--out", default=os.path.join(
      here, "..", "tests", "fixtures", "reference"))
  ap.add_argument("--only", nargs="*")
  a = ap.parse_args()
  os.makedirs(a.out, exist_ok=True)
  for c in CASES:
    if a.only and c["name"] not in a.only:
      continue
    make_case(c, a.out)


if __name__ == "__main__":
  main()
