"""The benchmark scripts' cases, run on the CPU at tiny shapes (Triton's interpreter): every timed call runs,
agrees with its reference, and reads its own operands. They only run for real on the GPU, where a bug costs
device time: a first bench_ops bound its MoE calls late, so every call ran the last call's operands, and
only the GPU showed it. Speed is not measured here."""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import bench_head  # noqa: E402
import bench_ops  # noqa: E402
import compile_sm90  # noqa: E402
import gpu_clocks  # noqa: E402
import sweep_attention  # noqa: E402

TOL = 2e-2   # bf16 outputs: max |provider - reference| over max |reference|


@pytest.fixture
def tiny(monkeypatch):
    """bench_ops on the CPU, two calls a replay, every shape small enough for the interpreter."""
    monkeypatch.setattr(bench_ops, "DEVICE", "cpu")
    monkeypatch.setattr(bench_ops, "CALLS", 2)
    monkeypatch.setattr(bench_ops, "QWEN3_NEXT_MOE", dict(e=8, k=2, h=64, i=32))
    monkeypatch.setattr(bench_ops, "QWEN3_NEXT_ATTN", dict(hq=4, hkv=2, d=32, ctx=48, bs=16))
    monkeypatch.setattr(bench_ops, "QWEN3_NEXT_SMALL", dict(h=64, v=1000, hq=4, hkv=2, d=32, blocks=16, bs=4))


@pytest.mark.parametrize("group", ["moe", "attention", "small"])
def test_bench_ops_cases_agree_with_their_references_and_each_call_reads_its_own_operands(tiny, group):
    cases = {"moe": bench_ops.moe_cases, "attention": bench_ops.attention_cases,
             "small": bench_ops.small_cases}[group]([1, 3])
    assert cases
    for name, m, floor_bytes, provs in cases:
        assert floor_bytes > 0 and len(provs["triton"]) == len(provs["reference"]) == bench_ops.CALLS, name
        for p in provs:
            if p != "reference":
                err = bench_ops._error(provs, p)
                assert math.isnan(err) if name.startswith("reshape_and_cache") else err < TOL, (name, m, p, err)
        if group != "small":        # the small ops reuse one input, as a decode step does
            first, second = (call() for call in provs["triton"])
            if isinstance(first, tuple):            # the router: (weights, ids)
                first, second = first[0], second[0]
            assert not torch.equal(first, second), f"{name} M={m}: its calls ran the same operands"


def test_bench_ops_times_the_nvfp4_moe_dot_kernels_beside_the_gemvs_only_where_the_gemvs_run(tiny, monkeypatch):
    from mtpfactory.kernels import moe
    monkeypatch.setattr(moe, "GEMV_MAX_ROWS", 2)
    cases = bench_ops.moe_cases([1, 3])
    dots = {(name.split()[1], m): "triton-dot" in provs for name, m, _, provs in cases if "fused_moe" in name}
    assert dots == {("bf16", 1): False, ("nvfp4", 1): True, ("bf16", 3): False, ("nvfp4", 3): False}


@pytest.mark.parametrize("context", [None, 80])
def test_sweep_attention_runs_every_variant_against_the_reference(tiny, monkeypatch, capsys, context):
    """The sweep's loop with the GPU's timing stubbed: one line a variant and setup, each with a small error, at
    the setups' context or the one --context asks."""
    monkeypatch.setattr(sweep_attention, "copy_bandwidth", lambda: 1e12)
    monkeypatch.setattr(sweep_attention, "graph_time_us", lambda calls: ([c() for c in calls] and 1.0,))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    # lists of two at the setups' context (stages one: the interpreter ignores them); at --context, one variant a
    # KV format (the interpreter's time)
    lists = ("1,3", "0,2", "2") if context is None else ("3", "2", "0")
    monkeypatch.setattr(sys, "argv", ["sweep_attention.py", "--batches", lists[0], "--splits", lists[1], "--block-n",
                                      "16", "--stages", lists[2], "--fast-dot", "1", "--rounds", "1",
                                      *(["--context", str(context)] if context else [])])
    assert sweep_attention.main() == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("paged_decode_attention")]
    assert len(rows) == 3 * math.prod(len(values.split(",")) for values in lists)   # KV formats x the lists
    assert all(f"context {context or 48} " in row for row in rows)
    assert all(float(row.rsplit("err ", 1)[1]) < TOL for row in rows)


def test_sweep_attention_names_an_unknown_kv_format_and_the_known_ones(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["sweep_attention.py", "--kv", "bf16,fp4"])
    with pytest.raises(SystemExit) as e:
        sweep_attention.main()
    assert e.value.code == 2
    assert "--kv bf16,fp4: fp4 unknown; the formats are bf16, fp8, fp8_scaled" in capsys.readouterr().err


@pytest.mark.parametrize("regs, shared, warps, want", [
    (168, 16384, 4, (3, "registers")),       # paged attention, FP8, one stage: 168 x 32 = 5376 a warp, 21504 a program
    (214, 25856, 4, (2, "registers")),       # three stages: 216 x 32 = 6912 a warp (regs a warp in units of 256)
    (127, 34816, 4, (4, "registers")),       # BF16, one stage: 128 x 128 = 16384 a program
    (32, 100000, 4, (2, "shared memory")),   # 2 x (100096 + 1024) of 233472 bytes
    (16, 0, 4, (16, "warps")),               # 64 warps an SM
    (16, 0, 1, (32, "programs")),            # 32 programs an SM at most
])
def test_programs_an_sm_follows_the_sm90_limits(regs, shared, warps, want):
    assert compile_sm90.programs_an_sm(regs, shared, warps) == want


FAKE_SMI = """#!/bin/sh
# nvidia-smi --query-gpu=... --format=csv -lms N, as a driver writes it: a header, then a row a period
echo "timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], temperature.gpu, \
clocks_event_reasons.active"
while true; do
  echo "$(date '+%Y/%m/%d %H:%M:%S').$(date '+%N' | cut -c1-3), $SM MHz, 3201 MHz, 690.12 W, 61, 0x0000000000000004"
  sleep 0.1
done
"""


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """A stand-in nvidia-smi first on the PATH, logging an SM clock of 1545 MHz."""
    (tmp_path / "nvidia-smi").write_text(FAKE_SMI)
    (tmp_path / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SM", "1545")


def test_the_clock_log_holds_what_nvidia_smi_wrote_while_a_window_ran(tmp_path, fake_smi):
    """`clock_log` runs nvidia-smi (here a stand-in that writes its CSV) while the block runs; `logged` keeps the
    rows inside a timing's windows and `summary` gives each quantity's range and the reasons seen."""
    with gpu_clocks.clock_log(str(tmp_path / "clocks.csv"), period_ms=100) as log:
        t0 = time.time()
        time.sleep(0.6)
        t1 = time.time()
    assert log == str(tmp_path / "clocks.csv")
    rows = gpu_clocks.logged(log, [(t0, t1)])
    assert 2 <= len(rows) <= 9
    assert gpu_clocks.summary(rows) == (f"sm 1545-1545 MHz, mem 3201-3201 MHz, 690-690 W, 61-61 C, reasons "
                                        f"0x0000000000000004 ({len(rows)} samples)")
    assert gpu_clocks.logged(log, [(t1 + 60, t1 + 61)]) == []
    assert gpu_clocks.summary([]) == "no clock samples"


def test_no_nvidia_smi_logs_nothing(monkeypatch):
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    with gpu_clocks.clock_log() as log:
        assert log is None
    assert gpu_clocks.logged(None, [(0.0, time.time())]) == []


def test_bench_ops_gives_each_row_the_clocks_logged_while_it_was_timed(tiny, tmp_path, fake_smi, monkeypatch,
                                                                       capsys):
    """bench_ops' loop with the GPU's timing stubbed (each replay 0.4 s, so the stand-in logs a few rows):
    every row, printed and in the JSON, carries what nvidia-smi logged while it ran."""
    def timed(calls):
        time.sleep(0.4)
        return 1.0, True, float("nan")
    monkeypatch.setattr(bench_ops, "copy_bandwidth", lambda: 1e12)
    monkeypatch.setattr(bench_ops, "graph_time_us", timed)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    out = tmp_path / "ops.json"
    monkeypatch.setattr(sys, "argv", ["bench_ops.py", "--ops", "small", "--ms", "1", "--rounds", "1",
                                      "--no-reference", "--clocks", str(tmp_path / "clocks.csv"), "--json", str(out)])
    assert bench_ops.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["clocks"].startswith("sm 1545-1545 MHz") for r in rows)
    lines = [line for line in capsys.readouterr().out.splitlines() if "while timed: sm 1545-1545 MHz" in line]
    assert len(lines) == len(rows)


def test_host_cost_times_every_op_with_its_kernels_not_launched():
    """scripts/host_cost.py in its own process (it stubs the interpreter's launches): a line an op, with --steps a
    line a head's step and one for the truncation it includes, and a refusal naming the ops for an unknown
    --profile."""
    run = subprocess.run([sys.executable, str(SCRIPTS / "host_cost.py"), "--calls", "3", "--rounds", "1", "--steps"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = [line.rsplit(None, 3)[0] for line in run.stdout.splitlines()[1:]]
    assert rows == ["rms_norm", "linear", "embedding", "embed_norm_cat", "rope_neox", "rms_norm_rope", "silu_mul",
                    "paged_decode_attention", "moe_route_softmax", "fused_moe", "argmax", "step dense", "truncate",
                    "step bf16_moe"]
    bad = subprocess.run([sys.executable, str(SCRIPTS / "host_cost.py"), "--profile", "nope"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "the ops are rms_norm, linear" in bad.stderr


def test_bench_ops_kernel_times_is_empty_without_a_gpu(tiny):
    """`--kernels`' profile needs a GPU's kernels (on one, each kernel's name and time a call): on the CPU it names
    none and runs nothing."""
    ran = []
    assert bench_ops.kernel_times([lambda: ran.append(0)]) == {} and ran == []


def test_bench_ops_short_kernel_name_drops_templates_and_parameters():
    """`--kernels` prints a kernel by its name alone: torch's copy kernel demangles to about a thousand characters
    (its first run on a GPU, the thirtieth, an H100, printed it whole)."""
    copy = ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
            "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>(int, at::native::x)")
    assert bench_ops.short_kernel_name(copy) == "at::native::elementwise_kernel"
    assert bench_ops.short_kernel_name("_moe_blend_kernel") == "_moe_blend_kernel"
    assert bench_ops.short_kernel_name("void gemv2T_kernel_val(int, float)") == "gemv2T_kernel_val"


@pytest.fixture
def tiny_heads(monkeypatch):
    """bench_head on the CPU at the tiny presets, every head it builds kept in the list returned. Both paths run
    the references here: the script's bookkeeping is what these tests check (the Triton path's steps under the
    interpreter take 2-50 s each, its one-row GEMVs' many programs; the heads' own tests check that path)."""
    monkeypatch.setattr(bench_head, "DEVICE", "cpu")
    monkeypatch.setattr(bench_head, "CASES", {"dense": ("dense", "qwen3_5_dense_tiny", ("quant=nvfp4",)),
                                              "moe": ("bf16_moe", "qwen3_next_tiny", ("kv=fp8",
                                                                                      "levers.kv_exact=true"))})
    built, build = [], bench_head.build

    def native_build(case, backend, *args):
        built.append(build(case, "native", *args))
        return built[-1]
    monkeypatch.setattr(bench_head, "build", native_build)
    return built


@pytest.mark.parametrize("case", ["dense", "moe"])
def test_bench_head_steps_every_batch_and_leaves_the_sequences_as_prefilled(tiny_heads, case):
    """Each batch's eager step on both paths (the graph needs a GPU), a row each with its floor; the routed experts
    counted from the steps (top-2 of one row: 2). A timing's steps advance the sequences, and each is truncated
    back to the context after it: the next timing starts from the same cache."""
    args = argparse.Namespace(context=37, steps=2, native_steps=1, rounds=2, native=True, kernels=False)
    rows = bench_head.run_case(case, [1, 2], args, bw=1e12, gen=torch.Generator().manual_seed(0))
    assert [(r["batch"], r["provider"]) for r in rows] == [(1, "triton eager"), (1, "native eager"),
                                                           (2, "triton eager"), (2, "native eager")]
    assert all(r["us"] > 0 and r["floor_us"] > 0 and r["peer_us"] > 0 for r in rows)
    assert [len(r["us_rounds"]) for r in rows] == [2, 1, 2, 1]      # the peer in the first round only
    if case == "moe":
        assert rows[0]["experts"] == 2 and 2 <= rows[2]["experts"] <= 4
    assert len(tiny_heads) == 2
    for head in tiny_heads:
        assert {s: (st.start, st.end) for s, st in head.cache.seqs.items()} == {0: (0, 37), 1: (0, 37)}


@pytest.mark.parametrize("case", ["dense", "moe"])
def test_bench_head_floor_counts_each_weight_once_the_embedding_rows_the_picked_experts_and_the_kv(tiny_heads,
                                                                                                   case):
    """With every expert picked the floor is every tensor of the head once but the embedding table, plus b rows
    of it and the KV of b sequences of context + 1 tokens (bf16; or FP8 codes with their fp32 scales)."""
    head = bench_head.build(case, "native", 2, 37, 2)
    tensors = {t.data_ptr(): t for t in (*head.parameters(), *head.buffers())}.values()
    everything = sum(t.numel() * t.element_size() for t in tensors)
    h, kv_heads, d = head.hidden_size, head.cache.spec.kv_heads, head.cache.spec.head_dim
    per_token = 2 * kv_heads * d * (2 if case == "dense" else 1 + 4 / d)     # dense: bf16 KV; moe: fp8 + scales
    embed = head.embed.numel() * head.embed.element_size()
    experts = head.ffn.experts.num_experts if case == "moe" else 0
    want = everything - embed + 3 * h * 2 + 3 * 38 * per_token
    assert bench_head.floor_bytes(head, 3, 37, experts) == int(want)
    if case == "moe":
        per_expert = sum(t.numel() * t.element_size() for t in head.ffn.experts.parameters()) / experts
        assert bench_head.floor_bytes(head, 3, 37, 2) == int(want - (experts - 2) * per_expert)


def test_bench_head_graphs_a_forward_that_rewrites_its_rows_and_leaves_the_sequences_as_prefilled(tiny_heads):
    """The graph column's call (`committed_forward`): the step's rows committed once, so that each replay rewrites
    them; the call gives a step's logits and hidden, the same on every call; the sequences end as prefilled."""
    head = bench_head.build("moe", "native", 3, 37, 2)
    bench_head.prefill(head, 3, 37, torch.Generator().manual_seed(0))
    with bench_head.committed_forward(head, 3, 37, torch.Generator().manual_seed(1)) as forward:
        assert {s: (st.start, st.end) for s, st in head.cache.seqs.items()} == {0: (0, 38), 1: (0, 38), 2: (0, 38)}
        (logits, hidden), (again, _) = forward(), forward()
    assert logits.shape == (3, head.vocab_size) and hidden.shape == (3, head.hidden_size)
    assert torch.equal(logits, again)
    assert {s: (st.start, st.end) for s, st in head.cache.seqs.items()} == {0: (0, 37), 1: (0, 37), 2: (0, 37)}


def test_bench_head_kernels_is_empty_without_a_gpu(tiny_heads):
    """--kernels profiles a GPU's kernels: on the CPU it names none, and the sequences stay as they were."""
    head = bench_head.build("moe", "native", 2, 37, 2)
    bench_head.prefill(head, 1, 37, torch.Generator().manual_seed(0))
    assert bench_head.step_kernels(head, 1, 37, torch.Generator().manual_seed(0)) == {}
    assert {s: (st.start, st.end) for s, st in head.cache.seqs.items()} == {0: (0, 37)}
