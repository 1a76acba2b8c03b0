"""slime's flags on this project's command line: every flag of slime's (arguments.py and the Search-R1 scripts at
slime 624b824, read from ../shared/compat) has an answer in slime_search/compat/slime_flags.toml, every answer holds
through the real parser (honoured: declared; accepted: its value passes, another is a usage error; refused: a usage
error saying what instead), slime's own run_qwen2.5_3B.sh command line parses, and --custom-config-path merges
slime's mis.yaml, checking each key as its flag."""

from __future__ import annotations

import argparse
import ast
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from slime_search.arguments import build_parser, parse_args
from slime_search.compat.flags import DATA_FILE, dest_of, vocabulary
from tests.compat.conftest import MIS, SEARCH_R1, SLIME_FILES, require_slime_files
from tests.conftest import REPO_ROOT

BASE = ["--hf-checkpoint", "ckpt", "--save", "run", "--prompt-data", "p.parquet", "--num-rollout", "2"]
BASE += ["--rollout-batch-size", "4", "--n-samples-per-prompt", "8"]
WANDB_KEY = "test-wandb-key"


def usage_error(capsys, argv: list[str]) -> str:
    """parse_args(argv) refused as a usage error (exit code 2, no traceback); its message."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "unrecognized arguments" not in err
    return err.splitlines()[-1]


# ---- slime's files, read as slime's parser and shell read them ------------------------------------------------------


def slime_argument_calls() -> list[ast.Call]:
    source = (require_slime_files() / "slime" / "utils" / "arguments.py").read_text()
    calls = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)]
    return [c for c in calls if getattr(c.func, "attr", getattr(c.func, "id", None)) in ("add_argument", "reset_arg")]


def slime_flag_names() -> set[str]:
    """Every option string slime's arguments.py declares (add_argument, and reset_arg which adds a Megatron flag)."""
    strings = [arg.value for call in slime_argument_calls() for arg in call.args if isinstance(arg, ast.Constant)]
    return {s for s in strings if isinstance(s, str) and s.startswith("--")}


def slime_explicit_dests() -> dict[str, str]:
    dests = {}
    for call in slime_argument_calls():
        dest = next((k.value.value for k in call.keywords if k.arg == "dest"), None)
        if dest is not None:
            dests[call.args[0].value] = dest
    return dests


def expand(text: str, env: dict[str, str]) -> str:
    """${NAME} and ${NAME:-default}, as bash expands them."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m[1], m[2] or ""), text)


def bash_arrays(path: Path, env: dict[str, str], uncomment: bool) -> dict[str, list[str]]:
    """NAME=( ... ) arrays of a slime script, one flag line a line; `uncomment`: a line commented out once is taken
    (`# --use-tis`), prose comments and lines commented out twice are not."""
    arrays = {}
    for name, body in re.findall(r"^(\w+)=\(\n(.*?)^\)", path.read_text(), re.M | re.S):
        tokens = []
        for line in body.splitlines():
            line = line.strip()
            if uncomment and line.startswith("#"):
                line = line[1:].strip()
            if line.startswith("--"):
                tokens += shlex.split(expand(line, env))
        arrays[name] = tokens
    return arrays


def slime_command_line(uncomment: bool = True) -> list[str]:
    """The arguments run_qwen2.5_3B.sh gives train.py, its arrays expanded (MODEL_ARGS from scripts/models)."""
    files = require_slime_files()
    env = {"WANDB_KEY": WANDB_KEY}
    script = files / "examples" / "search-r1" / "run_qwen2.5_3B.sh"
    arrays = bash_arrays(files / "scripts" / "models" / "qwen2.5-3B.sh", env, uncomment)
    arrays |= bash_arrays(script, env, uncomment)
    command = script.read_text().replace("\\\n", " ").split("python3 train.py", 1)[1].splitlines()[0]
    argv = []
    for token in shlex.split(command):
        array = re.fullmatch(r"\$\{(\w+)\[@\]\}", token)
        argv += arrays[array[1]] if array else [token]
    return argv


def script_flag_names() -> set[str]:
    files = require_slime_files()
    qwen3 = bash_arrays(files / "scripts" / "models" / "qwen3-4B.sh", {}, uncomment=True)["MODEL_ARGS"]
    return {token for token in slime_command_line() + qwen3 if token.startswith("--")}


# ---- (i) every slime flag has an answer -----------------------------------------------------------------------------


def test_every_flag_of_slimes_arguments_and_scripts_has_an_answer():
    names = slime_flag_names()
    assert len(names) > 200  # the walk found slime's parser, not an empty file
    assert sorted(names - set(vocabulary().flags)) == []
    scripts = script_flag_names()
    assert {"--pipeline-model-parallel-size", "--attention-backend", "--swiglu", "--qk-layernorm"} <= scripts
    assert sorted(scripts - set(vocabulary().flags)) == []
    assert vocabulary().slime_commit in str(SLIME_FILES)


def test_the_data_file_knows_slimes_attribute_for_each_flag():
    """--custom-config-path keys are slime's attributes: where slime sets dest=, the data file says so."""
    dests = {name: flag.dest for name, flag in vocabulary().flags.items()}
    for name, dest in slime_explicit_dests().items():
        assert dests[name] == dest, name
    assert dests["--pipeline-model-parallel-size"] == "pipeline_model_parallel_size"


def test_every_key_slimes_tis_helper_reads_can_be_set_from_a_config_file():
    require_slime_files()
    read = set(re.findall(r"\bargs\.(\w+)", (MIS / "mis.py").read_text()))
    ours = {action.dest for action in build_parser()._actions}
    assert read and sorted(read - ours - set(vocabulary().tis_keys)) == []
    assert set(yaml.safe_load((MIS / "mis.yaml").read_text())) <= ours | set(vocabulary().tis_keys)


# ---- (ii) every answer holds ----------------------------------------------------------------------------------------


def test_honoured_flags_are_this_projects_own():
    actions = {option: action for action in build_parser()._actions for option in action.option_strings}
    honoured = [flag.name for flag in vocabulary().answered("honoured")]
    assert sorted(name for name in honoured if name not in actions) == []
    assert [name for name in honoured if actions[name].help == argparse.SUPPRESS] == []  # in --help, documented


def test_accepted_and_refused_flags_take_no_attribute_of_ours():
    """They are declared with slime's attribute, absent unless given: a flag of ours is never shadowed, and a slime
    plugin still gets slime's default for what is not given (compat/boundary.py)."""
    parser = build_parser()
    hidden = {flag.dest for flag in vocabulary().answered("accepted") + vocabulary().answered("refused")}
    ours = {action.dest for action in parser._actions if action.help != argparse.SUPPRESS}
    assert sorted(hidden & ours) == []
    assert hidden.isdisjoint(vars(parse_args(BASE)))


def other_value(flag):
    """A value of the flag's kind that is not the accepted one."""
    if flag.kind == "json":
        return '{"enable_thinking": true}'
    if flag.kind == "str":
        return "something-else"
    step = 1 if flag.kind == "int" else 0.5
    return str(max(flag.values) + step)


def same_as_value(flag) -> str:
    return str(getattr(parse_args(BASE), dest_of(flag.same_as)))


ACCEPTED = vocabulary().answered("accepted")


@pytest.mark.parametrize("flag", ACCEPTED, ids=lambda flag: flag.name)
def test_an_accepted_flag_takes_the_value_this_project_runs_with_and_refuses_another(flag, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY)
    if flag.kind in ("switch", "bool"):
        with_colocate = ["--colocate"] if flag.same_as == "--colocate" else []
        assert getattr(parse_args([*BASE, flag.name, *with_colocate]), flag.dest) is True
        if flag.kind == "bool":
            negative = "--no-" + flag.name.removeprefix("--")
            assert getattr(parse_args([*BASE, negative]), flag.dest) is False
            assert negative in usage_error(capsys, [*BASE, negative, "--colocate"])
        if with_colocate:
            err = usage_error(capsys, [*BASE, flag.name])
            assert f"{flag.name} without --colocate" in err and flag.instead in err
        return
    if flag.same_as_env:
        assert not hasattr(parse_args([*BASE, flag.name, WANDB_KEY]), flag.dest)  # checked, then not kept
        err = usage_error(capsys, [*BASE, flag.name, "another-key"])
        assert flag.name in err and flag.instead in err and "another-key" not in err  # a key is never shown
        return
    if flag.same_as:
        accepted = [same_as_value(flag)]
        other = accepted[0] + ("1" if flag.kind == "int" else "-other")
    else:
        accepted = [json.dumps(v) if flag.kind == "json" else str(v) for v in flag.values]
        other = other_value(flag)
    for value in accepted:
        parsed = getattr(parse_args([*BASE, flag.name, value]), flag.dest)
        assert parsed in flag.values or str(parsed) == value
    err = usage_error(capsys, [*BASE, flag.name, other])
    assert flag.name in err and flag.instead in err


REFUSED = vocabulary().answered("refused")


@pytest.mark.parametrize("flag", REFUSED, ids=lambda flag: flag.name)
def test_a_refused_flag_is_a_usage_error_saying_what_instead(flag, capsys):
    err = usage_error(capsys, [*BASE, flag.name])
    assert f"{flag.name} is not supported here: {flag.why}; {flag.instead}" in err


def test_a_refused_flag_parses_with_slimes_values_before_it_is_refused(capsys):
    err = usage_error(capsys, [*BASE, "--rollout-stop", "</answer>", "</search>", "--rollout-top-k", "-1"])
    assert "--rollout-stop is not supported here" in err


def test_the_pipeline_parallel_refusal_says_what_to_use(capsys):
    err = usage_error(capsys, [*BASE, "--pipeline-model-parallel-size", "2"])
    assert "--pipeline-model-parallel-size 2: pipeline parallelism is not supported" in err
    assert "use --tensor-model-parallel-size" in err


def test_slimes_save_hf_folder_is_refused_by_name(capsys):
    assert parse_args([*BASE, "--save-hf"]).save_hf is True and parse_args(BASE).save_hf is False
    err = usage_error(capsys, [*BASE, "--save-hf", "/ckpt/hf_{rollout_id}"])
    assert "argument --save-hf: takes no folder here" in err and "SAVE/hf/step_N" in err


def test_an_sglang_server_flag_slime_would_pass_through_is_refused_saying_how_to_set_the_engines(capsys):
    err = usage_error(capsys, [*BASE, "--sglang-enable-dp-attention", "--sglang-dp-size", "2"])
    assert "--sglang-enable-dp-attention, --sglang-dp-size: SGLang's server flags are not passed through" in err
    assert "--engine-url" in err


def test_a_flag_no_one_knows_is_named_with_where_slimes_answers_are(capsys):
    err = usage_error(capsys, [*BASE, "--no-such-flag=3", "--sglang-foo"])
    assert "--no-such-flag: not a flag of this project, nor of slime at 624b824" in err
    assert "--sglang-foo: SGLang's server flags" in err


def test_the_slime_flags_are_one_described_group_of_the_help():
    text = build_parser().format_help()
    assert "slime flags accepted or refused" in text and "slime_flags.toml" in text
    assert "--custom-config-path" in text and "--pipeline-model-parallel-size" not in text


def test_the_data_file_ships_with_the_package():
    tree = ast.parse((REPO_ROOT / "setup.py").read_text())
    setup = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
    package_data = ast.literal_eval(next(k.value for k in setup.keywords if k.arg == "package_data"))
    assert DATA_FILE.name in package_data["slime_search.compat"]
    assert DATA_FILE.parent == REPO_ROOT / "slime_search" / "compat"


# ---- (iii) slime's Search-R1 command line ---------------------------------------------------------------------------


@pytest.fixture
def slime_run_environment(slime_files, slime_api, monkeypatch):
    """What slime's run script sets up: its plugins importable (PYTHONPATH: the example folder; slime's root for
    examples.train_infer_mismatch_helper), paths relative to slime's checkout, the wandb key in the environment."""
    monkeypatch.syspath_prepend(str(SEARCH_R1))
    monkeypatch.syspath_prepend(str(slime_files))
    monkeypatch.chdir(slime_files)
    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY)


def test_slimes_search_r1_command_line_parses_with_every_commented_option(slime_run_environment):
    argv = slime_command_line(uncomment=True)
    assert "--custom-config-path" in argv and "--use-tis" in argv and "--eval-input-key" in argv
    args = parse_args(argv)
    assert (args.tensor_model_parallel_size, args.sequence_parallel, args.colocate) == (2, True, True)
    assert (args.pipeline_model_parallel_size, args.attention_backend, args.hidden_dropout) == (1, "flash", 0.0)
    assert (args.eval_interval, args.eval_prompt_data[0], args.n_samples_per_eval_prompt) == (25, "nq_test", 1)
    assert args.custom_generate_function_path == "generate_with_search.generate"
    assert (args.use_tis, args.use_rs, args.tis_mode, args.rs_veto_threshold) == (True, True, "truncate", 1e-4)
    assert args.num_layers == 36 and args.num_query_groups == 2


def test_slimes_command_line_as_shipped_parses_given_the_run_folder(slime_run_environment):
    """Without the commented options it lacks only --save (commented out there), which names the run folder here."""
    argv = slime_command_line(uncomment=False)
    assert "--use-tis" not in argv and "--save" not in argv
    args = parse_args([*argv, "--save", "run"])
    assert (args.use_dynamic_batch_size, args.balance_data, args.max_tokens_per_gpu) == (True, True, 9216)
    assert not args.use_tis and args.custom_config_path is None


def test_slimes_command_line_with_pipeline_parallelism_is_refused_by_name(slime_run_environment, capsys):
    argv = slime_command_line()
    argv[argv.index("--pipeline-model-parallel-size") + 1] = "2"
    assert "--pipeline-model-parallel-size 2: pipeline parallelism is not supported" in usage_error(capsys, argv)


# ---- (iv) --custom-config-path --------------------------------------------------------------------------------------


def write_yaml(tmp_path: Path, data: dict) -> str:
    path = tmp_path / "custom.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_slimes_mis_yaml_is_merged_onto_the_flags(slime_files):
    args = parse_args([*BASE, "--custom-config-path", str(MIS / "mis.yaml")])
    expected = yaml.safe_load((MIS / "mis.yaml").read_text())
    assert {key: getattr(args, key) for key in expected} == expected
    assert (args.use_tis, args.tis_level, args.tis_lower_bound, args.rs_upper_bound) == (True, "token", 0.5, None)


def test_config_keys_are_converted_as_their_flags_and_override_the_command_line(tmp_path):
    path = write_yaml(tmp_path, {"lr": "3e-6", "eval_interval": 5, "tis_clip": 3, "rs_veto_threshold": "1e-4"})
    args = parse_args([*BASE, "--lr", "1e-6", "--custom-config-path", path])
    assert (args.lr, args.eval_interval, args.tis_cap, args.rs_veto_threshold) == (3e-6, 5, 3.0, 1e-4)
    path = write_yaml(tmp_path, {"micro_batch_size": 1, "attention_backend": "flash", "kl_loss_type": "k3"})
    args = parse_args([*BASE, "--custom-config-path", path])
    assert (args.micro_batch_size, args.attention_backend, args.kl_loss_type) == (1, "flash", "k3")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"no_such_flag": 1}, "no_such_flag in {path}: no flag of this project's or of slime's has this attribute"),
        (
            {"pipeline_model_parallel_size": 2},
            "pipeline_model_parallel_size in {path}: --pipeline-model-parallel-size 2:",
        ),
        ({"partial_rollout": True}, "partial_rollout in {path}: --partial-rollout is not supported here"),
        ({"eval_interval": "often"}, "eval_interval in {path}: expected an integer, got 'often'"),
        ({"kl_loss_type": "k9"}, "kl_loss_type in {path}: --kl-loss-type: 'k9' is not one of"),
        ({"use_kl_loss": "yes"}, "use_kl_loss in {path}: --use-kl-loss is a switch"),
        ({"tis_mode": "soft"}, "tis_mode in {path}: 'soft' is not one of truncate, clip, mask"),
        ({"grpo_std_normalization": False}, "write `advantage_estimator: dr_grpo`"),
        ({"kl_loss_coef": 0.1}, "--kl-loss-coef needs --use-kl-loss"),  # merged before the checks, checked alike
    ],
)
def test_a_config_key_that_cannot_be_taken_is_a_usage_error_naming_it(tmp_path, capsys, data, message):
    path = write_yaml(tmp_path, data)
    assert message.format(path=path) in usage_error(capsys, [*BASE, "--custom-config-path", path])


def test_a_missing_config_file_is_a_usage_error(tmp_path, capsys):
    missing = str(tmp_path / "absent.yaml")
    assert f"--custom-config-path {missing}: No such file" in usage_error(
        capsys, [*BASE, "--custom-config-path", missing]
    )
