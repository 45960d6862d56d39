"""The CLI, run as a user runs it."""

import subprocess
import sys

import pytest

from mtpfactory.cli import _check_heads


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


def test_a_refusal_during_the_demo_is_a_row_and_the_sweep_goes_on(tmp_path):
    # main_kv_blocks=1 caps the pool at one sequence's worth: the demo's third prefill finds it full
    run = cli("-m", "+head=dense", "runtime.max_seq_len=64", "runtime.main_kv_blocks=0,1", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    table = run.stdout[run.stdout.index("run "):].splitlines()
    assert len(table) == 2 + 2
    assert "main_kv_blocks=0" in table[2] and table[2].endswith("| ok")
    assert "main_kv_blocks=1" in table[3] and "refused: kv pool=" in table[3]


def test_a_sweep_of_one_run_is_a_sweep(tmp_path):
    """`-m` with one job still ends with the table, its refusal a row, exit status 0 (not a single run's 1)."""
    run = cli("-m", "+head=bf16_moe", "quant=fp8", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    table = run.stdout[run.stdout.index("run "):].splitlines()
    assert len(table) == 2 + 1 and "quant=fp8" in table[2] and "refused: " in table[2]


def test_a_single_refused_run_says_why_and_exits_1(tmp_path):
    run = cli("+head=dense", "runtime.max_seq_len=4", cwd=tmp_path)
    assert run.returncode == 1
    assert "refused: demo.k=4: needs runtime.max_seq_len >= demo.k + 2" in run.stdout
    assert "Traceback" not in run.stderr + run.stdout


@pytest.mark.parametrize("value, bad", [("choice(dense,bf16_moe)", None), ("dense,bf16_moe", None), ("glob(*)", None),
                                        ("choice(dense,bf16moe)", "did you mean 'bf16_moe'")])
def test_head_sweep_functions_are_checked_value_by_value(value, bad, capsys):
    if bad is None:
        _check_heads(["-m", f"+head={value}"])
        return
    with pytest.raises(SystemExit) as e:
        _check_heads(["-m", f"+head={value}"])
    assert e.value.code == 2 and bad in capsys.readouterr().err
