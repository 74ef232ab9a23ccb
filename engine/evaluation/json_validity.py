"""`miniapp eval json`: constrained decoding measured against issue 22's targets.

For each of the bundled JSON schemas (assets/schemas/json_schemas.json) the model answers
the schema's prompt greedily twice, with the schema as its constraint and without one, and
we record:

- validity: whether the constrained answer ended the turn (rather than being cut by
  max_tokens), parses as JSON, and validates against the schema (jsonschema, Draft 2020-12);
- cost: decode tok/s with and without the constraint (medians, and their ratio), the time
  to compile each schema (a `token_guide()`), the one-time build of llguidance's view of
  the vocabulary, and the time each masking step takes.

The masking steps are timed by wrapping `TokenGuide.allowed_after` (the matcher: which
tokens may come next), the whole mask (`mask_logits` on the torch engine, `mask_scores`
on llama.cpp, which include the matcher and set forbidden logits to -inf) and the one-token
check a greedy step makes before it (`allows`) for the duration of the run only
(`timed_masks`); the engine itself carries no timing code.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from importlib.resources import files

from ..chat.conversation import Conversation
from ..chat.generation import GenerationRequest, generate
from ..errors import MiniappError
from ..modelfile.template import Message
from ..runtimes.base import Runtime
from ..tokens.constraints import (
    OutputConstraint,
    TokenGuide,
    _ll_tokenizer,
    closing_reserve,
    token_guide,
)
from ..tokens.events import Finished, FinishReason, TextDelta
from ..tokens.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 384
WARMUP_TOKENS = 8  # the first generation pays one-time costs (thread pools, kernels)


@dataclass(frozen=True)
class SchemaCase:
    name: str
    prompt: str
    schema: dict


def schema_cases(limit: int | None = None) -> list[SchemaCase]:
    """The bundled schemas with their prompts, in file order (the first `limit` of them)."""
    path = files("miniapp.assets") / "schemas" / "json_schemas.json"
    cases = [SchemaCase(c["name"], c["prompt"], c["schema"]) for c in json.loads(path.read_text())]
    return cases[:limit] if limit else cases


@dataclass
class MaskTimes:
    """Seconds per call: the matcher alone (allowed_after), the whole mask, and the one-token
    checks a greedy step makes first (allows: the mask is computed only when they refuse)."""

    matcher: list[float] = field(default_factory=list)
    whole: list[float] = field(default_factory=list)
    checks: list[float] = field(default_factory=list)


@contextmanager
def timed_masks(times: MaskTimes) -> Iterator[MaskTimes]:
    """Time every TokenGuide mask while the block runs (a wrapper around the class's methods,
    put back afterwards)."""
    originals = {
        name: getattr(TokenGuide, name)
        for name in ("allowed_after", "mask_logits", "mask_scores", "allows")
    }

    def timing(method, into: list[float]):
        def timed(self, *args):
            start = time.perf_counter()
            try:
                return method(self, *args)
            finally:
                into.append(time.perf_counter() - start)

        return timed

    TokenGuide.allowed_after = timing(originals["allowed_after"], times.matcher)
    TokenGuide.mask_logits = timing(originals["mask_logits"], times.whole)
    TokenGuide.mask_scores = timing(originals["mask_scores"], times.whole)
    TokenGuide.allows = timing(originals["allows"], times.checks)
    try:
        yield times
    finally:
        for name, method in originals.items():
            setattr(TokenGuide, name, method)


@dataclass(frozen=True)
class Answer:
    text: str
    reason: str  # FinishReason's value
    generated_tokens: int
    decode_tok_s: float  # 0 when fewer than 2 tokens were generated
    drafted: int = 0  # speculative decoding's counts (0 without it)
    accepted: int = 0


@dataclass(frozen=True)
class SchemaResult:
    name: str
    finished: bool  # the constrained answer ended the turn (not cut by max_tokens)
    parsed: bool
    valid: bool
    problem: str | None  # why it did not parse or validate
    compile_s: float  # token_guide() for this schema
    mask_median_s: float | None  # the matcher (allowed_after), per call
    constrained: Answer
    free: Answer  # the same prompt without a constraint


@dataclass(frozen=True)
class JsonEvalReport:
    backend: str
    spec: str
    max_tokens: int
    total: int
    finished: int
    parsed: int
    valid: int
    cut_by_max_tokens: int  # constrained answers
    steered: int  # constrained answers that reached their budget's closing steps
    free_cut_by_max_tokens: int
    tokenizer_build_s: float  # llguidance's view of the vocabulary, once per tokenizer
    compile_median_s: float
    compile_max_s: float
    mask_calls: int
    mask_median_s: float  # the matcher, per call (allowed_after)
    mask_p90_s: float
    whole_mask_median_s: float  # the matcher plus setting forbidden logits to -inf
    whole_mask_p90_s: float
    check_calls: int
    check_median_s: float  # a greedy step's one-token check (allows)
    mask_share: float  # masks' and checks' seconds / the constrained answers' decode seconds
    decode_tok_s: float  # median over constrained answers of 2+ tokens
    free_decode_tok_s: float  # median over the same prompts' free answers of 2+ tokens
    ratio: float  # decode_tok_s / free_decode_tok_s
    paired_ratio_median: float  # median over prompts of (constrained / free) tok/s
    drafted: int  # speculation's drafts over the constrained answers (0 with --spec off)
    accepted: int
    free_drafted: int
    free_accepted: int
    schemas: list[SchemaResult]

    def to_dict(self) -> dict:
        """Everything, but the free answers' texts (up to max_tokens each)."""
        report = asdict(self)
        for schema in report["schemas"]:
            del schema["free"]["text"]
        return report

    @property
    def failures(self) -> list[SchemaResult]:
        """Schemas whose constrained answer did not end the turn with a valid value."""
        return [s for s in self.schemas if not (s.valid and s.finished)]


def evaluate_json_schemas(
    runtime: Runtime, cases: Sequence[SchemaCase], max_tokens: int = DEFAULT_MAX_TOKENS
) -> JsonEvalReport:
    """Greedy answers to each case's prompt, constrained by its schema and free; see the
    module's docstring for what is measured."""
    validator_for = _validator_factory()
    start = time.perf_counter()
    _ll_tokenizer(runtime.tokenizer)
    tokenizer_build_s = time.perf_counter() - start
    conversation = Conversation(runtime)
    prompts = [conversation.prompt_tokens([Message("user", c.prompt)]) for c in cases]
    _answer(runtime, prompts[0], None, WARMUP_TOKENS)

    results, masks = [], MaskTimes()
    for case, prompt in zip(cases, prompts, strict=True):
        constraint = OutputConstraint.json_schema(case.schema)
        start = time.perf_counter()
        token_guide(constraint, runtime.tokenizer, len(prompt))
        compile_s = time.perf_counter() - start
        calls = len(masks.matcher)
        with timed_masks(masks):
            constrained = _answer(runtime, prompt, constraint, max_tokens)
        free = _answer(runtime, prompt, None, max_tokens)
        parsed, valid, problem = _check(constrained.text, validator_for(case.schema))
        these = masks.matcher[calls:]
        results.append(
            SchemaResult(
                name=case.name,
                finished=constrained.reason == FinishReason.END_OF_TURN,
                parsed=parsed,
                valid=valid,
                problem=problem,
                compile_s=compile_s,
                mask_median_s=statistics.median(these) if these else None,
                constrained=constrained,
                free=free,
            )
        )
    return _report(runtime, max_tokens, tokenizer_build_s, results, masks)


def _answer(
    runtime: Runtime, prompt: list[int], constraint: OutputConstraint | None, max_tokens: int
) -> Answer:
    sampling = SamplingParams(temperature=0.0, constraint=constraint)
    text: list[str] = []
    for event in generate(runtime, prompt, GenerationRequest(max_tokens, sampling)):
        if isinstance(event, TextDelta):
            text.append(event.text)
        elif isinstance(event, Finished):
            stats, spec = event.stats, event.stats.speculation
            return Answer(
                "".join(text),
                event.reason.value,
                stats.generated_tokens,
                stats.decode_tok_s,
                spec.drafted if spec else 0,
                spec.accepted if spec else 0,
            )
    raise AssertionError("generate() ended without a Finished event")


def _validator_factory():
    """A function from a schema to its Draft 2020-12 validator (jsonschema is a development
    dependency, so its absence is a one-line error)."""
    try:
        from jsonschema import Draft202012Validator
    except ImportError:
        raise MiniappError(
            "miniapp eval json needs the jsonschema package (pip install jsonschema)"
        ) from None

    def validator_for(schema: dict):
        Draft202012Validator.check_schema(schema)
        return Draft202012Validator(schema)

    return validator_for


def _check(text: str, validator) -> tuple[bool, bool, str | None]:
    """(parses, validates, the first problem in one line)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return False, False, f"not JSON: {exc}"
    error = next(iter(validator.iter_errors(value)), None)
    if error is None:
        return True, True, None
    where = "/".join(map(str, error.absolute_path)) or "(root)"
    return True, False, f"{where}: {' '.join(error.message.split())[:200]}"


def _report(
    runtime: Runtime,
    max_tokens: int,
    tokenizer_build_s: float,
    results: list[SchemaResult],
    masks: MaskTimes,
) -> JsonEvalReport:
    constrained = [r.constrained for r in results]
    free = [r.free for r in results]
    with_schema = _median_speed(constrained)
    without = _median_speed(free)
    paired = [
        a.decode_tok_s / b.decode_tok_s
        for a, b in zip(constrained, free, strict=True)
        if a.decode_tok_s > 0 and b.decode_tok_s > 0
    ]
    compile_times = [r.compile_s for r in results]
    decode_s = sum(
        (a.generated_tokens - 1) / a.decode_tok_s for a in constrained if a.decode_tok_s > 0
    )
    cut = FinishReason.MAX_TOKENS.value
    return JsonEvalReport(
        backend=runtime.backend,
        spec=runtime.info().spec,
        max_tokens=max_tokens,
        total=len(results),
        finished=sum(r.finished for r in results),
        parsed=sum(r.parsed for r in results),
        valid=sum(r.valid for r in results),
        cut_by_max_tokens=sum(a.reason == cut for a in constrained),
        steered=sum(
            a.generated_tokens > max_tokens - closing_reserve(max_tokens) for a in constrained
        ),
        free_cut_by_max_tokens=sum(a.reason == cut for a in free),
        tokenizer_build_s=tokenizer_build_s,
        compile_median_s=statistics.median(compile_times),
        compile_max_s=max(compile_times),
        mask_calls=len(masks.matcher),
        mask_median_s=_quantile(masks.matcher, 0.5),
        mask_p90_s=_quantile(masks.matcher, 0.9),
        whole_mask_median_s=_quantile(masks.whole, 0.5),
        whole_mask_p90_s=_quantile(masks.whole, 0.9),
        check_calls=len(masks.checks),
        check_median_s=_quantile(masks.checks, 0.5),
        mask_share=(sum(masks.whole) + sum(masks.checks)) / decode_s if decode_s else 0.0,
        decode_tok_s=with_schema,
        free_decode_tok_s=without,
        ratio=with_schema / without if without else 0.0,
        paired_ratio_median=statistics.median(paired) if paired else 0.0,
        drafted=sum(a.drafted for a in constrained),
        accepted=sum(a.accepted for a in constrained),
        free_drafted=sum(a.drafted for a in free),
        free_accepted=sum(a.accepted for a in free),
        schemas=results,
    )


def _median_speed(answers: Sequence[Answer]) -> float:
    speeds = [a.decode_tok_s for a in answers if a.decode_tok_s > 0]
    return statistics.median(speeds) if speeds else 0.0


def _quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (nearest rank) of `values`; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]
