"""The GPU kit's markdown report (`tools.gpu_check.kit` writes it as OUT/gpu_kit.md): a table per part, then the log
tail of every part that failed."""

from __future__ import annotations

import json


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def _short_error(error: str) -> str:
    """The error's head for a table cell: an out-of-memory error keeps how much it asked for, with its unit."""
    import re

    asked = re.search(r"Tried to allocate [0-9.]+ [KMG]iB", error)
    if error.startswith("out of memory") and asked:
        return f"out of memory ({asked.group(0)[len('Tried to allocate ') :]} asked)"
    return error[:80]


def _check_result(record: dict) -> str:
    if "error" in record:
        return f"error: {record['error'][:120]}"
    if record["check"] == "parity":
        return f"max abs logit diff {_fmt(record['max_abs_logit_diff'])}"
    if record["check"] == "log_probs":
        return f"max abs diff vs HF {_fmt(record['max_abs_diff_vs_hf'])}"
    if record["check"] == "gather":
        return f"{record['tensors']} tensors, max abs diff {_fmt(record['max_abs_diff'])}"
    if record["check"] == "attention":
        return (
            f"packed vs local: logits {_fmt(record['max_abs_logit_diff'])}, log-probs "
            f"{_fmt(record['max_abs_log_prob_diff'])}, gradients {_fmt(record['max_abs_grad_diff'])} "
            f"(largest gradient {_fmt(record['max_abs_grad'])})"
        )
    if record["check"] == "train":
        last = record["steps"][-1]
        exact = record.get("offload", {}).get("bit_exact_after_onload")
        return (
            f"step 4 loss {_fmt(last['loss'], 6)}, grad norm {_fmt(last['grad_norm'], 6)}; bit-exact hand-over {exact}"
        )
    return json.dumps(record)[:120]


def checks_table(records: list[dict]) -> list[str]:
    lines = [
        "## checks: the actor against Hugging Face",
        "",
        "| check | family | dtype | result |",
        "|---|---|---|---|",
    ]
    for r in records:
        if r.get("check") != "environment":
            lines.append(f"| {r.get('check')} | {r.get('family')} | {r.get('dtype')} | {_check_result(r)} |")
    return lines


def _recipe_line(r: dict) -> str:
    return (
        f"{r.get('model')}, {r.get('params_dtype')}, attention {r.get('attention_impl')}, recompute "
        f"{r.get('recompute')}, {r.get('max_tokens_per_gpu')} tokens per micro-batch, distributed optimizer "
        f"{r.get('distributed_optimizer')}, KL {r.get('kl')}; for one device: "
        f"{'; '.join(r.get('changed_for_one_device') or ['nothing changed'])}."
    )


def _peak(r: dict) -> str:
    if "peak_allocated_gib" in r:
        return f"{r['peak_allocated_gib']} allocated / {r['peak_reserved_gib']} reserved of {r['device_total_gib']}"
    return f"{r.get('peak_host_resident_gib')} (process peak RSS)"


def recipe_table(r: dict) -> list[str]:
    lines = ["## recipe_step: the 3B recipe's step at TP 1", "", _recipe_line(r), ""]
    if "error" in r:
        return lines + [f"**{_short_error(r['error'])}**; peak {_peak(r)} GiB"]
    lines += [
        f"{r['samples']} samples, {r['tokens_per_step']} tokens per step; peak memory {_peak(r)} GiB.",
        "",
        "| step | old log-probs (s) | reference log-probs (s) | update (s) | step (s) | loss | grad norm |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, s in enumerate(r["steps"], 1):
        lines.append(
            f"| {i} | {s['old_log_probs_s']} | {_fmt(s['ref_log_probs_s'])} | {s['train_step_s']} | {s['step_s']} | "
            f"{_fmt(s.get('loss'), 6)} | {_fmt(s.get('grad_norm'), 6)} |"
        )
    return lines


def handover_table(r: dict) -> list[str]:
    lines = ["## handover: the colocated hand-over of actor and reference", "", _recipe_line(r), ""]
    if "error" in r:
        return lines + [f"**{_short_error(r['error'])}**"]
    lines += [
        "| round | offload (s) | onload (s) | GiB handed | host GiB gained | device GiB used: before / handed over / "
        "after | device GiB freed | byte for byte after |",
        "|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for i, t in enumerate(r["rounds"], 1):
        used = " / ".join(_fmt(t[k].get("device_used_gib")) for k in ("before", "offloaded", "after"))
        exact = ", ".join(f"{name} {ok}" for name, ok in t["bit_exact"].items())
        lines.append(
            f"| {i} | {t['offload_s']} | {t['onload_s']} | {t['gib_handed']} | {_fmt(t.get('host_gib_gained'))} | {used} | "
            f"{_fmt(t.get('device_gib_freed'))} | {exact} |"
        )
    after = r.get("step_after", {})
    return lines + ["", f"The step after: loss {_fmt(after.get('loss'), 6)}, applied {after.get('step_applied')}."]


def gather_table(r: dict) -> list[str]:
    lines = ["## gather: the push's weight gather on the actor's state", "", _recipe_line(r), ""]
    if "error" in r:
        return lines + [f"**{_short_error(r['error'])}**"]
    lines += [
        f"Buckets of {r['bucket_bytes']} bytes; every parameter sent: {r['every_parameter_sent']} "
        f"({r['parameters']} parameters).",
        "",
        "| pass | seconds | buckets | tensors | GiB | peak above the actor (GiB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for p in r["passes"]:
        name = "gather + flatten (tensor transport)" if p["flattened"] else "gather (broadcast)"
        lines.append(
            f"| {name} | {p['seconds']} | {p['buckets']} | {p['tensors']} | {p['gib']} | "
            f"{_fmt(p.get('peak_above_actor_gib'))} |"
        )
    return lines


def ipc_table(records: list[dict]) -> list[str]:
    summary = next((r for r in records if "pushes" in r), None)
    pushes = summary["pushes"] if summary else [r for r in records if "push" in r]
    lines = ["## ipc: the tensor transport's buckets between two processes", ""]
    if summary:
        lines += [
            f"{summary['transport']}; {summary['tensors']} tensors, {summary['state_gib']} GiB, buckets of "
            f"{summary['bucket_bytes']} bytes; the consumer's copy equals the producer's weights: "
            f"{summary.get('consumer_weights_equal')}; device memory steady over the pushes: "
            f"{summary.get('device_used_steady')}.",
            "",
        ]
    lines += [
        "| push | buckets | largest (MiB) | seconds | buckets read wrong | most left reserved after a bucket (MiB) | "
        "device GiB used after |",
        "|---:|---:|---:|---:|---|---:|---:|",
    ]
    for i, p in enumerate(pushes, 1):
        lines.append(
            f"| {i} | {p['buckets']} | {p['largest_bucket_mib']} | {p['seconds']} | {p['buckets_read_wrong'] or 'none'} "
            f"| {_fmt(p['most_left_reserved_mib'])} | {_fmt(p['device_used_gib'])} |"
        )
    return lines


def checkpoint_table(r: dict) -> list[str]:
    steps = r["second_step"]
    lines = [
        "## checkpoint: convert, train, save, resume",
        "",
        _recipe_line(r),
        "",
        f"Weights and optimizer state equal after `load_actor`: {r['weights_and_optimizer_equal_after_load']} "
        f"({r['tensors_compared']} tensors); the second step bit-identical: {r['second_step_bit_identical']} (loss "
        f"{_fmt(steps['continued']['loss'], 8)} / {_fmt(steps['resumed']['loss'], 8)}, grad norm "
        f"{_fmt(steps['continued']['grad_norm'], 8)} / {_fmt(steps['resumed']['grad_norm'], 8)}). Conversion "
        f"{r['convert_s']} s ({r['converted_bytes']} bytes), save {r['save_s']} s, load {r['load_s']} s.",
        "",
        "| file | bytes |",
        "|---|---:|",
    ]
    return lines + [f"| {name} | {size} |" for name, size in r["checkpoint_files"].items()]


TABLES = {
    "recipe_step": recipe_table,
    "handover": handover_table,
    "gather": gather_table,
    "checkpoint": checkpoint_table,
}


def markdown(report: dict) -> str:
    """The tables of gpu_kit.md."""
    env = report["environment"]
    lines = [
        f"# GPU kit: {env.get('device', '?')}",
        "",
        f"`{report['command']}`, {report['seconds']} s; torch {env.get('torch', '?')}, "
        f"TransformerEngine {'yes' if env.get('transformer_engine') else 'no'}.",
        "",
        "| part | return code | seconds |",
        "|---|---|---:|",
    ]
    lines += [f"| {p['part']} | {p['returncode']} | {p['seconds']} |" for p in report["parts"]]
    for part in report["parts"]:
        records = [r for r in part["records"] if isinstance(r, dict)]
        if not records:
            continue
        if part["part"] == "checks":
            table = checks_table(records)
        elif part["part"] == "ipc":
            table = ipc_table(records)
        elif part["part"] in TABLES:
            table = TABLES[part["part"]](records[-1])
        else:
            continue
        lines += ["", *table]
    for p in report["parts"]:
        if p["returncode"] != 0:
            lines += ["", f"### {p['part']} failed ({p['returncode']})", "", "```", p["log_tail"][-1500:], "```"]
    return "\n".join(lines) + "\n"
