"""Every option a lesson script accepts changes what the run does, or is refused with one line.

The options are read from each script's own parser (its main() is called with parse_args replaced, so nothing
trains and no process group starts). Each option must be either
  - checked: EFFECTS names the test in tests/test_NN_*.py (or the check function a test calls) that passes it
    (the option is written in that function's source) and asserts what it changes; or
  - refused: a shared option the script leaves out of its parser (base_parser(without=...)) or an option listed
    in REFUSED; passing it ends the script at once with one line naming it.
A new option that is in neither fails below, naming it and what to do. This file runs no training: it reads
parsers and test sources, and launches each script once with its refused options.
"""

import ast
import functools
import importlib.util
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.harness.launch import ROOT, python
from utils.training import EVERY_SCRIPT_OPTIONS, SHARED_OPTIONS
from utils.training import parse_args as real_parse_args

SCRIPTS = {path.name[:2]: path for path in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.py"))}
SHARED_RUN = "test_shared_options_change_the_run"  # one run with every shared option off its default

# (lesson, option) -> the test that passes the option and checks its effect, in tests/test_<script>.py
EFFECTS = {
    "00": {
        **{option: SHARED_RUN for option in SHARED_OPTIONS},
        "--autocast": "test_todo1_training_step_matches_the_reference_step",
    },
    "01": {
        "--steps": "test_script_runs_and_writes_metrics",
        "--sizes": "test_script_runs_and_writes_metrics",
        "--benchmark-out": "test_script_runs_and_writes_metrics",
        "--skip-benchmark": "test_runs_without_torchrun_as_a_world_of_one",
        "--metrics-out": "test_runs_without_torchrun_as_a_world_of_one",
    },
    "02": {
        **{option: SHARED_RUN for option in SHARED_OPTIONS},
        "--autocast": "test_autocast_bf16_is_honoured_as_in_lesson_00",
        "--ddp": "check_todo7",  # called by test_todo7_each_ddp_option_gets_its_wrapper
        "--grad-accum": "check_todo9",  # called by test_todo9_no_sync_accumulation_matches_one_large_batch
        "--bucket-cap-mb": "check_todo7",  # the buckets it makes, checked with --ddp
        "--lr-scaling": SHARED_RUN,
        "--trace": SHARED_RUN,
    },
    "03": {
        **{option: SHARED_RUN for option in SHARED_OPTIONS if option != "--autocast"},  # --autocast: refused
        "--strategy": "test_strategy_all_trains_each_strategy_in_turn",
        "--precision": "test_bf16_loss_stays_near_fp32",
        "--replicas": "test_replicas_sets_hsdps_mesh",
        "--reshard-after-forward": "test_no_reshard_after_forward_gathers_each_block_once",
        "--bucket-cap-mb": "test_bucket_cap_mb_cuts_zero2s_gradients_into_buckets",
        "--momentum": "test_one_process_reference_is_sgd_with_momentum_written_out",
        "--save-dcp": "test_save_dcp_writes_every_ranks_shards_and_resume_starts_after_its_step",
        "--resume": "test_save_dcp_writes_every_ranks_shards_and_resume_starts_after_its_step",
    },
    "04": {
        **{option: SHARED_RUN for option in SHARED_OPTIONS if option != "--autocast"},
        "--tp-impl": "test_tp_impl_and_sequence_parallel_change_the_layers_and_the_collectives",
        "--sequence-parallel": "test_tp_impl_and_sequence_parallel_change_the_layers_and_the_collectives",
    },
    "05": {
        **{option: SHARED_RUN for option in SHARED_OPTIONS if option != "--autocast"},
        "--pp-impl": "test_pp_impl_schedule_and_microbatches_shape_what_each_rank_runs",
        "--schedule": "test_pp_impl_schedule_and_microbatches_shape_what_each_rank_runs",
        "--microbatches": "test_pp_impl_schedule_and_microbatches_shape_what_each_rank_runs",
        "--bubble-sweep": "test_bubble_sweep_runs_both_schedules_at_every_m_and_writes_the_file",
        "--crash-at-step": "test_a_rank_dying_mid_schedule_ends_the_job",
    },
    "06": {
        **{option: SHARED_RUN for option in SHARED_OPTIONS if option != "--autocast"},
        "--tp": "test_options_reach_the_run",
        "--pp": "test_options_reach_the_run",
        "--impl": "test_options_reach_the_run",
        "--schedule": "test_options_reach_the_run",
        "--microbatches": "test_options_reach_the_run",
    },
    "07": {
        **{option: SHARED_RUN for option in SHARED_OPTIONS},
        "--autocast": "test_autocast_bf16_runs_the_forward_in_bf16",
        "--method": "test_16_bit_compression_halves_the_bytes_and_nearly_matches_full_precision",
        "--topk-ratio": "test_todo2_topk_sends_k_values_and_indices",
        "--bits": "test_todo4_every_bits_sends_its_bytes_and_trains",
        "--powersgd-rank": "test_powersgd_sends_rank_times_rows_plus_columns",
        "--local-steps": "test_todo5_local_sgd_averages_every_h_steps",
        "--compress-start": "test_post_local_sgd_averages_periodically_after_warm_up",
        "--local-group-size": "test_post_local_sgd_averages_periodically_after_warm_up",
    },
    "08": {
        **{option: SHARED_RUN for option in SHARED_OPTIONS if option not in ("--autocast", "--checkpoint")},
        "--checkpoint-dir": "test_damaged_checkpoint_skipped_and_resume_at_another_world_size",
        "--checkpoint-every": "test_reference_run_keeps_the_last_k_checkpoints",
        "--keep": "test_reference_run_keeps_the_last_k_checkpoints",
        "--async-save": "test_killed_rank_restarts_and_ends_bit_identical",
        "--token-noise": SHARED_RUN,
        "--warmup-steps": SHARED_RUN,
        "--crash-at-step": "test_killed_rank_restarts_and_ends_bit_identical",
        "--crash-rank": "test_killed_rank_restarts_and_ends_bit_identical",
        "--crash-during-save": "test_kill_during_save_keeps_the_previous_checkpoint",
        "--slow-steps": SHARED_RUN,
        "--slow-save": SHARED_RUN,
    },
    "09": {
        **{option: SHARED_RUN for option in SHARED_OPTIONS if option != "--autocast"},
        "--impl": "test_impl_and_cp_split_change_what_the_run_does",
        "--cp-split": "test_impl_and_cp_split_change_what_the_run_does",
    },
    "10": {
        **{option: SHARED_RUN for option in SHARED_OPTIONS if option != "--autocast"},
        "--experts": "test_options_and_measurements_reach_the_metrics",
        "--top-k": "test_options_and_measurements_reach_the_metrics",
        "--dispatch": "test_options_and_measurements_reach_the_metrics",
        "--capacity-factor": "test_options_and_measurements_reach_the_metrics",
        "--aux-loss-weight": "test_options_and_measurements_reach_the_metrics",
        "--impl": "test_options_and_measurements_reach_the_metrics",
    },
    "11": {
        **{option: SHARED_RUN for option in SHARED_OPTIONS if option not in ("--autocast", "--checkpoint")},
        "--autocast": "test_speed_up_options_reach_the_step",
        "--strategy": "test_every_rank_writes_a_trace_whose_kinds_add_up",
        "--profile": "test_every_rank_writes_a_trace_whose_kinds_add_up",
        "--ddp-overlap": "test_overlap_and_buckets_change_the_all_reduces",
        "--bucket-cap-mb": "test_overlap_and_buckets_change_the_all_reduces",
        "--prefetch": "test_fsdp_prefetch_and_reshard_options",
        "--reshard-after-forward": "test_fsdp_prefetch_and_reshard_options",
        "--microbatches": "test_pipeline_and_tensor_parallel_traces",
        "--optimizer-impl": "test_speed_up_options_reach_the_step",
        "--checkpointing": "test_speed_up_options_reach_the_step",
        "--compile": "test_compile_wraps_every_block",
    },
}
# Options every course parser has (utils.training.EVERY_SCRIPT_OPTIONS), lesson 01's too: one mechanism for all
# scripts (parse_args asks, setup() starts), checked once by the named test in tests/test_monitor.py.
EVERY_SCRIPT_EFFECTS = {"--watch": "test_watch_records_every_rank_into_the_metrics"}
EVERY_SCRIPT_TESTS = ROOT / "tests" / "test_monitor.py"
assert set(EVERY_SCRIPT_EFFECTS) == set(EVERY_SCRIPT_OPTIONS), "name the test of each option every script has"
for _lesson in SCRIPTS:
    EFFECTS.setdefault(_lesson, {}).update(EVERY_SCRIPT_EFFECTS)
# Options a script refuses beyond the shared ones it leaves out: lesson -> {option: a value to pass}.
REFUSED = {"01": {"--seed": "1"}}  # lesson 01 draws no random numbers from it: it had no effect
# Lessons whose options are not all in EFFECTS yet: their unlisted options are reported as expected failures.
PENDING: dict[str, str] = {}  # every lesson's options are named today
# A value for each shared option, to pass it where it is refused.
SAMPLE_VALUE = {"--autocast": "bf16", "--checkpoint": "model.pt", "--wandb": None, "--data-dir": "data"}
LIMIT_S = 60  # seconds on a loaded machine; an idle one refuses in about one (the time to import torch)


class Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


@functools.cache
def parser_of(lesson: str):
    """The parser lesson `lesson`'s main() builds, captured at its parse_args call (main goes no further)."""
    path = SCRIPTS[lesson]
    spec = importlib.util.spec_from_file_location(f"options_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def capture(parser, argv=None):
        raise Captured(parser)

    def setup(*args, **kwargs):
        raise AssertionError(f"{path.name} starts its process group before it parses its command line")

    module.parse_args, module.setup = capture, setup
    try:
        module.main()
    except Captured as captured:
        return captured.parser
    raise AssertionError(f"{path.name}: main() never called parse_args")


def options_of(lesson: str) -> list[str]:
    """The script's options, by their long names (without --help)."""
    actions = [a for a in parser_of(lesson)._actions if "--help" not in a.option_strings]
    return [next(s for s in a.option_strings if s.startswith("--")) for a in actions]


def uses_shared_command_line(lesson: str) -> bool:
    return "base_parser(" in SCRIPTS[lesson].read_text()


def refused(lesson: str) -> dict:
    """option -> a value, for every option the script refuses."""
    left_out = set(SHARED_OPTIONS) - set(options_of(lesson)) if uses_shared_command_line(lesson) else set()
    return {**{option: SAMPLE_VALUE.get(option, "1") for option in sorted(left_out)}, **REFUSED.get(lesson, {})}


def lesson_test_files(lesson: str) -> list:
    """The lesson's test files: tests/test_NN_topic.py (or several, tests/test_NN_*.py), and the tests of the
    options every script has."""
    return [*sorted((ROOT / "tests").glob(f"test_{lesson}_*.py")), EVERY_SCRIPT_TESTS]


def source_of_test(lesson: str, name: str) -> str | None:
    """The source of test or check function `name` (with its decorators) in the lesson's test files, or None."""
    for path in lesson_test_files(lesson):
        text = path.read_text()
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                return "\n".join(text.splitlines()[first - 1 : node.end_lineno])
    return None


ALL_OPTIONS = [(lesson, option) for lesson in SCRIPTS for option in options_of(lesson)]


@pytest.mark.parametrize("lesson, option", ALL_OPTIONS, ids=[f"{lesson}{option}" for lesson, option in ALL_OPTIONS])
def test_every_option_is_checked_or_refused(lesson, option):
    script, tests = SCRIPTS[lesson].name, " or ".join(str(p.relative_to(ROOT)) for p in lesson_test_files(lesson))
    assert option not in refused(lesson), f"{script} {option}: listed as refused, yet its parser accepts it"
    name = EFFECTS.get(lesson, {}).get(option)
    if name is None and lesson in PENDING:
        pytest.xfail(f"{script} {option}: no test named for its effect yet ({PENDING[lesson]})")
    assert name is not None, (
        f"{script} {option} is neither checked nor refused: add a test to {tests} that passes {option} and asserts "
        f"what it changes, and name it in EFFECTS in tests/test_options.py; or leave it out of the parser "
        f"(base_parser(without=...)) if the script cannot honour it"
    )
    source = source_of_test(lesson, name)
    assert source is not None, f"{script} {option}: EFFECTS names {name}, which {tests} does not define"
    assert f'"{option}"' in source, (
        f"{script} {option}: {name} in {tests} does not pass {option} (the option is not written in its source)"
    )
    if not name.startswith("test_"):  # a check function: some test must call it, or it checks nothing
        tests_calling = [
            node.name
            for path in lesson_test_files(lesson)
            for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
            for call in ast.walk(node)
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == name
        ]
        assert tests_calling, f"{script} {option}: EFFECTS names {name}, which no test in {tests} calls"


@pytest.mark.parametrize("lesson", list(EFFECTS))
def test_effects_table_names_only_options_the_script_has(lesson):
    stale = sorted(set(EFFECTS[lesson]) - set(options_of(lesson)))
    assert not stale, f"{SCRIPTS[lesson].name} has no options {stale}: remove them from EFFECTS"


REFUSING = [lesson for lesson in SCRIPTS if refused(lesson)]


@pytest.mark.parametrize("lesson", REFUSING)
def test_refused_options_end_the_parse_with_one_line(lesson, capsys):
    """In this process: the script's own parser, through the shared checks, refuses each option on one line."""
    for option, value in refused(lesson).items():
        argv = [option] if value is None else [option, value]
        with pytest.raises(SystemExit) as stopped:
            real_parse_args(parser_of(lesson), argv)
        message = capsys.readouterr().err.strip()
        assert stopped.value.code == 2 and len(message.splitlines()) == 1, f"{option}: {message}"
        assert option in message, f"{SCRIPTS[lesson].name}: the message should name {option}: {message}"


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Each script launched once with all its refused options, side by side: {lesson: Run}."""
    tmp = tmp_path_factory.mktemp("refused")

    def launch(lesson):
        argv = [
            part
            for option, value in refused(lesson).items()
            for part in ([option] if value is None else [option, value])
        ]
        return lesson, python(
            SCRIPTS[lesson],
            [*argv, "--log-dir", tmp / lesson] if uses_shared_command_line(lesson) else argv,
            timeout=LIMIT_S,
        )

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(launch, REFUSING))


@pytest.mark.parametrize("lesson", REFUSING)
def test_script_refuses_its_refused_options_at_once(launched, lesson):
    """The script itself: exit 2, one line naming every refused option, no traceback, no process group."""
    run = launched[lesson]
    lines = [line for line in run.output.splitlines() if line.strip()]
    assert run.returncode == 2 and len(lines) == 1, f"{SCRIPTS[lesson].name}: exit {run.returncode}:\n{run.tail()}"
    missing = [option for option in refused(lesson) if option not in lines[0]]
    assert not missing, f"{SCRIPTS[lesson].name}: the line should name {missing}: {lines[0]}"
