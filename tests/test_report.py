"""utils/report.py: the scaling table and figure from a folder of metrics files (generated here)."""

import json
import subprocess
import sys

import pytest

from tests.harness.launch import ROOT
from utils.report import comparison_rows, comparison_table, figure, layout_name, read_runs, scaling_rows, select, table


def write_run(folder, name, world_size, tokens_per_s, nodes=1, **layout):
    hosts = [f"node{rank * nodes // world_size}" for rank in range(world_size)]
    record = {"world_size": world_size, "tokens_per_s": tokens_per_s, "hosts": hosts, "final_loss": 5.0, **layout}
    (folder / f"{name}.json").write_text(json.dumps(record))


@pytest.fixture
def runs_dir(tmp_path):
    # Layout A (tp=1, pp=1) over 1-8 GPUs, two runs at 4; layout B (tp=2, pp=2) at 4 and 8 GPUs on 2 nodes.
    for gpus, speed in ((1, 1000.0), (2, 1900.0), (8, 6400.0)):
        write_run(tmp_path, f"a{gpus}", gpus, speed, tp=1, pp=1)
    write_run(tmp_path, "a4_first", 4, 3500.0, tp=1, pp=1)
    write_run(tmp_path, "a4_second", 4, 3700.0, tp=1, pp=1)
    write_run(tmp_path, "b4", 4, 3000.0, layout={"dp": 1, "tp": 2, "pp": 2})
    (tmp_path / "nested").mkdir()
    write_run(tmp_path / "nested", "b8", 8, 5400.0, nodes=2, layout={"dp": 2, "tp": 2, "pp": 2})
    (tmp_path / "notes.json").write_text('{"what": "not a metrics file"}')
    (tmp_path / "broken.json").write_text("{")
    return tmp_path


def test_rows_are_median_speedup_and_efficiency(runs_dir):
    runs = read_runs(runs_dir)
    assert len(runs) == 7  # the notes and the broken file are skipped
    rows = {(row["layout"], row["gpus"]): row for row in scaling_rows(runs)}
    assert set(rows) == {("tp=1 pp=1", n) for n in (1, 2, 4, 8)} | {("tp=2 pp=2", 4), ("tp=2 pp=2", 8)}
    a4, a8 = rows["tp=1 pp=1", 4], rows["tp=1 pp=1", 8]
    assert a4["runs"] == 2 and a4["tokens_per_s"] == 3600.0  # the median of 3500 and 3700
    assert a4["speedup"] == pytest.approx(3.6) and a4["efficiency"] == pytest.approx(0.9)
    assert a8["speedup"] == pytest.approx(6.4) and a8["efficiency"] == pytest.approx(0.8)
    b8 = rows["tp=2 pp=2", 8]  # against its own smallest run, 4 GPUs
    assert b8["base_gpus"] == 4 and b8["speedup"] == pytest.approx(1.8) and b8["efficiency"] == pytest.approx(0.9)
    assert b8["nodes"] == 2 and a8["nodes"] == 1


def test_layout_name_leaves_dp_out():
    assert layout_name({"layout": {"dp": 4, "tp": 2, "pp": 1}, "impl": "scratch"}) == "impl=scratch tp=2 pp=1"
    named = layout_name({"impl": "builtin", "schedule": "1f1b", "tp": 2, "pp": 2})
    assert named == "impl=builtin schedule=1f1b tp=2 pp=2"
    assert layout_name({"world_size": 2}) == "all runs"


def test_table_prints_every_row(runs_dir):
    text = table(scaling_rows(read_runs(runs_dir)))
    lines = text.splitlines()
    assert len(lines) == 1 + 6 and "efficiency" in lines[0]
    assert "6.40x" in text and "80%" in text and "1.80x" in text


def test_figure_is_readable(runs_dir):
    fig = figure(scaling_rows(read_runs(runs_dir)), "test machine")
    assert fig._suptitle.get_text() == "test machine"
    for ax in fig.axes:
        assert ax.get_title() and "(" in ax.get_xlabel() and "(" in ax.get_ylabel()  # units in brackets
        labels = [text.get_text() for text in ax.get_legend().get_texts()]
        assert any("tp=2 pp=2" in label for label in labels)
        texts = [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.get_xticklabels(), *ax.get_legend().get_texts()]
        assert min(text.get_fontsize() for text in texts) >= 10
    speed_ax = fig.axes[0]
    measured = speed_ax.get_lines()[0]  # layout A's tokens/s, then its linear-scaling line
    assert list(measured.get_xdata()) == [1, 2, 4, 8] and list(measured.get_ydata()) == [1000, 1900, 3600, 6400]
    assert list(speed_ax.get_lines()[1].get_ydata()) == [1000, 2000, 4000, 8000]


def run_report(*args):
    command = [sys.executable, "-m", "utils.report", *map(str, args)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_command_line_writes_table_and_figure(runs_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("figure") / "scaling.png"
    result = run_report(runs_dir, "--out", out, "--title", "generated runs")
    assert result.returncode == 0, result.stderr
    assert "tp=2 pp=2" in result.stdout and "6.40x" in result.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_line_refuses_an_empty_folder_in_one_line(tmp_path):
    result = run_report(tmp_path)
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0 and "--metrics-out" in result.stderr
    result = run_report(tmp_path / "missing")
    assert result.returncode == 1 and "not a folder" in result.stderr


@pytest.fixture
def two_implementations(tmp_path):
    """Lesson 06 from scratch on 1, 2, 4 and 8 GPUs, built in on 2, 4 and 8, as a sweep of each leaves them."""
    for gpus, speed in ((1, 1000.0), (2, 1800.0), (4, 3200.0), (8, 5600.0)):
        write_run(tmp_path, f"scratch{gpus}", gpus, speed, impl="scratch", layout={"dp": gpus, "tp": 1, "pp": 1})
    for gpus, speed in ((2, 2000.0), (4, 3600.0), (8, 7000.0)):
        write_run(tmp_path, f"builtin{gpus}", gpus, speed, impl="builtin", layout={"dp": gpus, "tp": 1, "pp": 1})
    return tmp_path


def test_two_curves_compared_at_the_world_sizes_both_ran(two_implementations):
    rows = scaling_rows(read_runs(two_implementations))
    scratch, builtin = select(rows, "impl=scratch"), select(rows, "impl=builtin")
    assert {row["layout"] for row in scratch} == {"impl=scratch tp=1 pp=1"}  # dp is what grows: left out
    compared = comparison_rows(scratch, builtin)
    assert [row["gpus"] for row in compared] == [2, 4, 8]  # the built-in has no 1-GPU run
    assert [row["ratio"] for row in compared] == pytest.approx([2000 / 1800, 3600 / 3200, 7000 / 5600])
    # Each curve's efficiency against its own smallest run: scratch from 1 GPU, built-in from 2.
    assert compared[-1]["first_efficiency"] == pytest.approx(5600 / 1000 / 8)
    assert compared[-1]["second_efficiency"] == pytest.approx(7000 / 2000 / 4)
    text = comparison_table(scratch, builtin)
    assert "A: impl=scratch tp=1 pp=1" in text and "B: impl=builtin tp=1 pp=1" in text and "1.25x" in text
    fig = figure(scratch + builtin, "scratch against built-in")
    labels = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    assert any("impl=scratch" in label for label in labels) and any("impl=builtin" in label for label in labels)
    plotted = [list(line.get_ydata()) for line in fig.axes[1].get_lines()[:2]]  # then the 100 % line
    assert plotted == [[100 * row["efficiency"] for row in curve] for curve in (scratch, builtin)]


def test_a_selection_names_one_layout_or_says_which_exist(two_implementations):
    rows = scaling_rows(read_runs(two_implementations))
    with pytest.raises(ValueError, match="selects no layout: pick one of: impl=builtin tp=1 pp=1; impl=scratch"):
        select(rows, "impl=other")
    with pytest.raises(ValueError, match="selects 2 layouts"):
        select(rows, "tp=1")


def test_command_line_compares_two_layouts(two_implementations):
    result = run_report(two_implementations, "--compare", "impl=scratch", "impl=builtin")
    assert result.returncode == 0, result.stderr
    assert "B / A" in result.stdout and "1.25x" in result.stdout
    assert (two_implementations / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = run_report(two_implementations, "--compare", "impl=scratch", "tp=9")
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0 and "--compare: 'tp=9'" in result.stderr
