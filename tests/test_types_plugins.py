import inspect
import textwrap

import pytest

from slime_search.plugins import PluginLoadError, load_function
from slime_search.types import Sample, Status


def test_append_keeps_tokens_mask_and_log_probs_aligned():
    sample = Sample(tokens=[1, 2, 3])
    sample.append_response_tokens([10, 11], generated=True, log_probs=[-0.1, -0.2], text="<search>q</search>")
    sample.append_response_tokens([20, 21, 22], generated=False, text="<information>d</information>")
    sample.append_response_tokens([30], generated=True, log_probs=[-0.3], text="<answer>a</answer>")
    assert sample.tokens == [1, 2, 3, 10, 11, 20, 21, 22, 30]
    assert sample.prompt_length == 3
    assert sample.response_tokens == [10, 11, 20, 21, 22, 30]
    assert sample.loss_mask == [1, 1, 0, 0, 0, 1]
    assert sample.rollout_log_probs == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3]
    assert sample.response == "<search>q</search><information>d</information><answer>a</answer>"


def test_append_rejects_misaligned_spans_and_leaves_sample_unchanged():
    sample = Sample(tokens=[1])
    with pytest.raises(ValueError, match="needs as many log-probs, got 1"):
        sample.append_response_tokens([5, 6], generated=True, log_probs=[-1.0])
    with pytest.raises(ValueError, match="needs as many log-probs, got none"):
        sample.append_response_tokens([5], generated=True)
    with pytest.raises(ValueError, match="take no log-probs"):
        sample.append_response_tokens([5], generated=False, log_probs=[-1.0])
    assert sample.tokens == [1] and sample.response_length == 0
    sample.loss_mask.append(1)  # corrupt it by hand: the next append must refuse
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 0 response tokens"):
        sample.append_response_tokens([5], generated=False)


def test_round_trip_and_trainable_status():
    sample = Sample(prompt="q", tokens=[1], group_index=3, index=7, label=["a"])
    sample.append_response_tokens([2], generated=True, log_probs=[-0.5])
    sample.status = Status.FAILED
    restored = Sample.from_dict(sample.to_dict())
    assert restored == sample
    assert not restored.trainable
    assert Sample(status=Sample.Status.TRUNCATED).trainable
    bad = sample.to_dict() | {"loss_mask": []}
    with pytest.raises(ValueError, match="loss_mask"):
        Sample.from_dict(bad)


def test_load_function_resolves_the_reward_plugin_with_slime_signature():
    fn = load_function("slime_search.search_r1.reward.reward_func")
    assert inspect.iscoroutinefunction(fn)
    params = list(inspect.signature(fn).parameters.values())
    assert [p.name for p in params[:2]] == ["args", "sample"]
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD


def test_load_function_errors_name_what_failed(tmp_path, monkeypatch):
    (tmp_path / "plugin_with_bad_import.py").write_text("import not_a_real_package_xyz\n\ndef fn():\n    pass\n")
    (tmp_path / "plugin_ok.py").write_text(textwrap.dedent("VALUE = 3\n\ndef fn():\n    return 42\n"))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_function("plugin_ok.fn")() == 42
    with pytest.raises(PluginLoadError, match="module 'no_such_mod' not found"):
        load_function("no_such_mod.fn")
    with pytest.raises(PluginLoadError, match="because 'not_a_real_package_xyz' is missing"):
        load_function("plugin_with_bad_import.fn")
    with pytest.raises(PluginLoadError, match="has no attribute 'missing'"):
        load_function("plugin_ok.missing")
    with pytest.raises(PluginLoadError, match="is a int, not a callable"):
        load_function("plugin_ok.VALUE")
    with pytest.raises(PluginLoadError, match="dotted path"):
        load_function("justaname")


def test_the_generate_modules_check_args_and_preflight_hooks_are_optional(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from slime_search.plugins import check_plugin_args, run_preflight

    (tmp_path / "plugin_hooks.py").write_text(
        textwrap.dedent(
            """
            async def generate(args, sample, sampling_params):
                return sample

            def check_args(args):
                if args.turns < 0:
                    raise ValueError(f"--turns must be >= 0, got {args.turns}")

            def preflight(args):
                args.seen.append("preflight")
            """
        )
    )
    (tmp_path / "plugin_plain.py").write_text("async def generate(args, sample, sampling_params):\n    return sample\n")
    (tmp_path / "plugin_odd_hook.py").write_text("check_args = 3\n\nasync def generate(args, sample, p):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = SimpleNamespace(turns=1, seen=[])
    check_plugin_args("plugin_hooks.generate", args)
    run_preflight("plugin_hooks.generate", args)
    assert args.seen == ["preflight"]
    with pytest.raises(ValueError, match="--turns must be >= 0"):
        check_plugin_args("plugin_hooks.generate", SimpleNamespace(turns=-1))
    check_plugin_args("plugin_plain.generate", args)  # no hooks: nothing to check
    run_preflight("plugin_plain.generate", args)
    with pytest.raises(PluginLoadError, match="plugin_odd_hook.check_args must be a function"):
        check_plugin_args("plugin_odd_hook.generate", args)
    with pytest.raises(PluginLoadError, match="has no attribute 'missing'"):  # the plugin path itself is checked
        run_preflight("plugin_hooks.missing", args)
