"""`miniapp calibrate`: measure early-exit drafting on this machine and store the best
setting for the model (keyed by the file's hash, in the user cache directory)."""

from __future__ import annotations

import argparse
import json
import sys

from miniapp.engine.api import MiniappError, RuntimeConfig, open_runtime, resolve_model


def run_calibrate(args: argparse.Namespace) -> int:
    from miniapp.engine.evaluation.calibrate import calibrate
    from miniapp.engine.speculative.calibration import save_exit_setting

    model_path = resolve_model(args.model)
    config = RuntimeConfig(
        str(model_path), "torch", ctx=1024, threads=args.threads, spec="off", device=args.device
    )
    runtime = open_runtime(config)
    if args.train_head or args.measure_head:
        return _train_head(runtime, args)
    n_layers = runtime.model.config.n_layers
    if args.layers and max(args.layers) >= n_layers:
        raise MiniappError(f"--layers: {model_path.name} has layers 1..{n_layers - 1} to exit at")

    def report(line: str) -> None:
        if not args.json:
            print(line, file=sys.stderr, flush=True)

    result = calibrate(
        runtime, args.layers, args.train_adapter, report, args.prompts, args.answer_tokens
    )
    try:
        stored = save_exit_setting(model_path, result.setting)
    except OSError as exc:
        raise MiniappError(f"cannot store the calibration: {exc}") from exc
    setting = result.setting
    if args.json:
        print(
            json.dumps(
                {
                    "model": str(model_path),
                    "plain_step_ms": result.plain_step_s * 1000,
                    "layers": [
                        {
                            "layer": r.layer,
                            "agreement": r.agreement,
                            "draft_step_ms": r.draft_s * 1000,
                            "predicted_speedup": {str(k): v for k, v in r.speedup.items()},
                        }
                        for r in result.layers
                    ],
                    "adapter_agreement": result.adapter_agreement,
                    "setting": setting.to_json(),
                    "stored": str(stored),
                }
            )
        )
        return 0
    print(f"plain decode step: {result.plain_step_s * 1000:.1f} ms")
    print(
        f"{'exit layer':>10} {'agreement':>10} {'draft ms':>9}  predicted speed-up by draft length"
    )
    for r in result.layers:
        speedups = "  ".join(f"k={k}: {v:.2f}" for k, v in r.speedup.items())
        print(f"{r.layer:>10} {r.agreement:>10.2f} {r.draft_s * 1000:>9.2f}  {speedups}")
    if result.adapter_agreement:
        before, after = result.adapter_agreement
        print(f"exit adapter: held-out agreement {before:.2f} -> {after:.2f}")
    verdict = "pays" if setting.pays else "does not pay; --spec auto will not use early exit"
    print(
        f"best: exit after layer {setting.layer}, up to {setting.max_draft} drafts, predicted "
        f"{setting.predicted_speedup:.2f}x ({verdict})"
    )
    print(f"stored in {stored}")
    return 0


class _Bars:
    """Phases as lines on stderr, counts as a tqdm bar (nothing with --json)."""

    def __init__(self, quiet: bool):
        self.quiet, self.bar, self.unit = quiet, None, ""

    def phase(self, text: str) -> None:
        self.close()
        if not self.quiet:
            print(text, file=sys.stderr, flush=True)

    def advance(self, done: int, total: int, note: str = "") -> None:
        if self.quiet:
            return
        unit = note.split(",")[0]
        if self.bar is None or self.unit != unit or self.bar.total != total:
            from tqdm import tqdm

            self.close()
            self.bar, self.unit = tqdm(total=total, unit=" " + unit, file=sys.stderr), unit
        self.bar.set_postfix_str(note.partition(", ")[2], refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _train_head(runtime, args: argparse.Namespace) -> int:
    """`calibrate --train-head`: the drafting head, trained, measured and stored;
    `--measure-head`: the stored one measured again (its costs move with the engine)."""
    import shutil

    from miniapp.engine.evaluation.head_training import (
        HeadTrainingPlan,
        measure_head,
        train_drafting_head,
    )
    from miniapp.engine.evaluation.shallow_training import measure_block, train_shallow_block
    from miniapp.engine.speculative.calibration import head_path, shallow_path

    flag = "--measure-head" if args.measure_head else "--train-head"
    if runtime.model.head_device.type != "cpu" or runtime.model.head_weight is None:
        raise MiniappError(f"{flag}: the drafting head runs on the CPU; use --device cpu")
    shallow = args.head_form == "shallow"
    stored = (shallow_path if shallow else head_path)(runtime.model_path)
    # Corpus shards and checkpoints: a rerun resumes, and either form reads the other's corpus.
    work = head_path(runtime.model_path).with_suffix(".work")
    plan = HeadTrainingPlan(prompts=args.head_prompts, steps=args.head_steps)
    bars = _Bars(args.json)
    try:
        if args.measure_head:
            weights, meta = _stored_head(runtime, shallow)
            measure = measure_block if shallow else measure_head
            meta.update(measure(runtime, weights, plan, bars))
        elif shallow:
            weights, meta = train_shallow_block(runtime, work, plan, bars, args.exit_layer)
        else:
            weights, meta = train_drafting_head(runtime, work, plan, bars)
        if not args.measure_head:
            form = f" --head-form shallow --exit-layer {weights.layer}" if shallow else ""
            meta["command"] = (
                f"miniapp calibrate --train-head{form} --head-prompts "
                f"{plan.prompts} --head-steps {plan.steps}"
            )
    finally:
        bars.close()
    try:
        weights.save(stored, meta)
    except OSError as exc:
        raise MiniappError(f"cannot store the drafting head: {exc}") from exc
    if not args.measure_head:  # an interrupted training's work is kept for its rerun
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps({"model": str(runtime.model_path), "stored": str(stored), **meta}))
        return 0
    form = f"shallow-exit block after layer {weights.layer}" if shallow else "drafting head"
    print(
        f"{form}: held-out first-draft acceptance {meta['acceptance']:.2f}, "
        f"draft vocabulary {meta['vocab_size']} tokens\n"
        f"costs: plain step {meta['plain_step_ms']:.2f} ms, each verified row "
        f"{meta['row_cost']:.3f} steps, each head pass {meta['draft_cost']:.3f} steps\n"
        f"best: up to {meta['max_draft']} drafts while the head is at least "
        f"{meta['threshold']:.2f} sure, predicted {meta['predicted_speedup']:.2f}x "
        f"({'pays' if meta['pays'] else 'does not pay; --spec auto will not use it'})\n"
        f"stored in {stored}"
    )
    return 0


def _stored_head(runtime, shallow: bool):
    """(weights, meta) of the stored head in the form asked for; a one-line error if none."""
    from miniapp.engine.speculative.calibration import load_head_weights, load_shallow_weights

    held = (load_shallow_weights if shallow else load_head_weights)(
        runtime.model_path, runtime.model
    )
    if held is None:
        form = " --head-form shallow" if shallow else ""
        raise MiniappError(
            f"--measure-head: no drafting head{' (shallow form)' if shallow else ''} is trained "
            f"for {runtime.model_path.name}; run `miniapp calibrate --train-head{form}` first"
        )
    return held
