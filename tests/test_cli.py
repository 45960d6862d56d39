"""The CLI, run as a user runs it."""

import subprocess
import sys

import pytest


def cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "mtpfactory", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=180)


@pytest.mark.parametrize("head, ffn", [("dense", "ffn=swiglu, 0 experts"), ("bf16_moe", "ffn=moe, 8 experts")])
def test_run_builds_prefills_and_drafts(head, ffn, tmp_path):
    run = cli(f"+head={head}", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert f"MTP head {head}: quant=bf16" in run.stdout and ffn in run.stdout
    assert "step " in run.stdout and "KV blocks in use" in run.stdout
    assert list(tmp_path.iterdir()) == []  # a single run leaves nothing behind


@pytest.mark.parametrize("args, says", [((), "no head chosen"), (("+head=bf16moe",), "did you mean 'bf16_moe'"),
                                        (("-m", "+head=dense,nope"), "head='nope'")])
def test_missing_or_unknown_head_exits_2_listing_heads(args, says, tmp_path):
    run = cli(*args, cwd=tmp_path)
    assert run.returncode == 2
    assert says in run.stderr and "bf16_moe, dense" in run.stderr


def test_multirun_ends_with_a_table_and_refused_rows_do_not_stop_it(tmp_path):
    run = cli("-m", "+head=dense,bf16_moe", "model=qwen3_5_dense_tiny", "runtime.max_seqs=2,3", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    table = run.stdout[run.stdout.index("run "):].splitlines()
    assert len(table) == 2 + 4
    assert sum("refused: model.num_experts" in row for row in table) == 2
    ok = [row for row in table if "+head=dense" in row]
    assert len(ok) == 2 and all("/" in row for row in ok)  # KV blocks in use / pool
