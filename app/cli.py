"""The `miniapp` command: argument parsing and the one-line error policy.

Every user-fixable problem (bad model file, bad flag value, missing input) is a MiniappError:
it prints one line naming the cause and exits with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version

from miniapp.engine.api import (
    BACKENDS,
    DEFAULT_CTX,
    DEVICE_CHOICES,
    LOCAL_BACKENDS,
    POOLING_CHOICES,
    SPEC_MODES,
    MiniappError,
    check_kv_policy,
)

from .host.remote import add_remote_flags
from .host.settings import KV_TYPE_HELP, kv_type_name
from .host.settings import add_flags as add_setting_flags
from .host.settings import apply as apply_settings

EXIT_USAGE = 2
TASKS = ("summarize", "quote", "chat")
EXIT_INTERRUPTED = 130


def _version() -> str:
    try:
        return version("miniapp")
    except PackageNotFoundError:
        return "unknown"


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _layer_list(text: str) -> list[int]:
    try:
        layers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        message = f"expected comma-separated layer numbers, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    if not layers or min(layers) < 1:
        raise argparse.ArgumentTypeError(f"layers must be positive, got {text!r}")
    return layers


def _add_model_args(
    parser: argparse.ArgumentParser, ctx_default: int | None, backends=LOCAL_BACKENDS
) -> None:
    parser.add_argument(
        "--model", help="GGUF path or bundled model name (default: smollm2-135m-instruct)"
    )
    parser.add_argument("--backend", choices=backends, default="torch")
    parser.add_argument("--threads", type=_positive_int, help="CPU threads (default: all)")
    parser.add_argument(
        "--device",
        choices=DEVICE_CHOICES,
        default="auto",
        help="torch engine: auto (a GPU if torch sees one, else the CPU), cuda, rocm or cpu",
    )
    parser.add_argument(
        "--cpu-moe",
        action="store_true",
        help="torch engine on a GPU: keep a mixture of experts' experts on the CPU, attention "
        "and shared weights on the GPU (also chosen when the experts do not fit)",
    )
    parser.add_argument(
        "--ctx", type=_positive_int, default=ctx_default, help="context size in tokens"
    )
    parser.add_argument(
        "--window",
        type=_positive_int,
        help="torch engine: recent tokens kept once the context is full (default: ctx - sinks)",
    )
    parser.add_argument(
        "--sinks",
        type=_non_negative_int,
        help="torch engine: first tokens always kept as attention sinks (default: 4)",
    )
    parser.add_argument(
        "--kv-policy",
        type=check_kv_policy,
        metavar="POLICY",
        help="torch engine: which tokens the cache keeps once it is full: window (the sinks "
        "and the most recent --window tokens), attention (the sinks, the recent half and "
        "the tokens attention used most; SnapKV on prompts, TOVA while answering) or "
        "attention-compact (the same, the kept keys re-rotated into contiguous positions at "
        "each eviction; measured worse, kept for comparison)",
    )


def _add_kv_type_arg(parser: argparse.ArgumentParser, help_more: str = "") -> None:
    # Left out (None): the torch engine's default, llama.cpp's own f16.
    parser.add_argument(
        "--kv-type",
        type=kv_type_name,
        metavar="TYPE",
        help=KV_TYPE_HELP + (help_more or "; --backend llamacpp keeps its f16 unless given"),
    )


def _add_spec_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec",
        choices=SPEC_MODES,
        default="auto",
        help="speculative decoding (torch engine; output is unchanged): auto picks prompt "
        "lookup when it pays, and the drafting head or early exit where `miniapp calibrate` "
        "found they pay",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miniapp", description="Local, offline inference on GGUF models."
    )
    parser.add_argument("--version", action="version", version=f"miniapp {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command")

    chat = sub.add_parser("chat", help="chat in the terminal")
    # Model, sampling and cache flags come from the settings model (flags > environment >
    # config file > defaults; `miniapp config show`).
    add_setting_flags(chat, "chat")
    add_remote_flags(chat, settings=True)
    chat.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    chat.add_argument("--stats", action="store_true", help="print speed after every answer")
    chat.add_argument(
        "--voice",
        action="store_true",
        help="push-to-talk: Enter on an empty line records until the next Enter",
    )
    chat.add_argument("--audio", metavar="FILE", help="send this audio file's transcript")
    chat.add_argument(
        "--image",
        metavar="PATH",
        action="append",
        default=[],
        help="attach an image to the first message (repeatable): read by OCR, or shown to a "
        "vision model when the model has a projector",
    )
    chat.add_argument(
        "--mmproj",
        metavar="PATH",
        help="the vision projector (mmproj GGUF) for the model (default: one beside the model)",
    )
    chat.add_argument(
        "--show-prompt",
        action="store_true",
        help="print each fully rendered prompt (template, image text, history) to stderr",
    )
    add_lora_flags(chat, serving=False)
    shape = chat.add_mutually_exclusive_group()
    shape.add_argument(
        "--json",
        action="store_true",
        help="every answer is a JSON object (with piped input: exactly the value is printed)",
    )
    shape.add_argument(
        "--json-schema",
        metavar="FILE",
        help="every answer is JSON valid against this JSON schema (a .json file)",
    )

    evaluate = sub.add_parser("eval", help="evaluate a model")
    eval_sub = evaluate.add_subparsers(dest="eval_command", required=True)
    ppl = eval_sub.add_parser("ppl", help="perplexity over a text file (llama.cpp's method)")
    ppl.add_argument("file", help="UTF-8 text file")
    _add_model_args(ppl, ctx_default=512)
    _add_kv_type_arg(ppl)
    ppl.add_argument("--json", action="store_true", help="print one JSON object")
    ppl.add_argument(
        "--recompute",
        action="store_true",
        help="with --window: the baseline that evaluates each window from scratch",
    )
    ppl.add_argument("--stride", type=_positive_int, help="--recompute step (default window/8)")

    compare = eval_sub.add_parser(
        "compare", help="teacher-forced top-1 agreement of our engine with llama.cpp"
    )
    compare.add_argument("file", help="UTF-8 text file")
    _add_model_args(compare, ctx_default=512)
    _add_kv_type_arg(compare, " (our engine's; llama.cpp, the oracle, keeps its f16)")
    compare.add_argument("--json", action="store_true", help="print one JSON object")

    _add_asr_eval_parser(eval_sub)
    _add_json_eval_parser(eval_sub)
    _add_recall_eval_parser(eval_sub)
    rerank = eval_sub.add_parser(
        "rerank",
        help="how well the model ranks documents by relevance (what /v1/rerank serves): "
        "top-1 and MRR on a small written set",
    )
    rerank.add_argument(
        "--model", help="GGUF path or bundled model name (default: smollm2-135m-instruct)"
    )
    rerank.add_argument("--threads", type=_positive_int, help="CPU threads (default: all)")
    rerank.add_argument("--json", action="store_true", help="print one JSON object")

    bench = sub.add_parser("bench", help="our engine vs llama.cpp, side by side")
    bench.add_argument(
        "mode",
        nargs="?",
        choices=["serve", "lora", "moe", "embeddings"],
        help="serve: many clients at once on the batching engine (see --clients); lora: "
        "what a LoRA adapter costs (load, decode, mixed batches), beside llama.cpp; moe: a "
        "mixture of experts' steps (1-8 sequences, verification rows), the bytes each reads; "
        "embeddings: texts a second through /v1/embeddings beside llama-server's",
    )
    _add_model_args(bench, ctx_default=None, backends=BACKENDS)
    _add_kv_type_arg(bench, " (our engine's; llama.cpp, the yardstick, keeps its f16)")
    bench.add_argument(
        "--llamacpp-kv-type",
        type=kv_type_name,
        metavar="TYPE",
        help="llama.cpp's KV cache in the same run (default: its own f16)",
    )
    bench.set_defaults(backend=None)
    add_remote_flags(bench)
    prompt = bench.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-tokens", type=_positive_int, default=128)
    prompt.add_argument("--prompt-file", help="use this text file's tokens as the prompt")
    bench.add_argument("--tokens", type=_positive_int, default=128, help="tokens to generate")
    bench.add_argument("--repeat", type=_positive_int, default=5, help="runs; medians reported")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument(
        "--models",
        metavar="LIST",
        help="the table for several models in one run (plain decoding), each beside its "
        "bandwidth floor: comma-separated names or paths, or 'installed'",
    )
    bench.add_argument(
        "--task",
        choices=TASKS,
        help="a chat prompt instead of raw text: summarize or quote one of the sample texts "
        "(about 500 tokens), or open chat questions; answers stop at end of turn",
    )
    _add_spec_arg(bench)
    bench.set_defaults(spec=None)
    bench.add_argument(
        "--http",
        action="store_true",
        help="bench serve: also measure our engine through `miniapp serve`'s "
        "HTTP API (the same prompts, as streamed completions)",
    )
    bench.add_argument(
        "--clients", default="1,2,4,8", help="bench serve: client counts to measure, e.g. 1,2,4,8"
    )
    bench.add_argument(
        "--requests",
        type=_positive_int,
        default=4,
        help="bench serve: requests each client sends, back to back",
    )

    bench.add_argument(
        "--lora-rank", type=_positive_int, default=16, help="bench lora: the adapters' rank"
    )
    bench.add_argument(
        "--adapters",
        type=_positive_int,
        default=4,
        help="bench lora: different adapters among the clients (the last --clients count)",
    )

    doctor = sub.add_parser("doctor", help="devices, kernels and the path a model would take")
    doctor.add_argument("--model", help="GGUF path or bundled model name")
    doctor.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    doctor.add_argument(
        "--cpu-moe",
        action="store_true",
        help="plan a mixture of experts with its experts on the CPU",
    )
    doctor.add_argument(
        "--ctx", type=_positive_int, default=DEFAULT_CTX, help="context for the estimate"
    )
    doctor.add_argument(
        "--kv-type",
        type=kv_type_name,
        metavar="TYPE",
        help=KV_TYPE_HELP + ", for the KV cache estimate (default: the engine's for the device)",
    )
    doctor.add_argument("--json", action="store_true", help="print one JSON object")
    doctor.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="PATH",
        help="also check a LoRA adapter for the model: its rank, bytes and load time (repeatable)",
    )

    calibrate = sub.add_parser(
        "calibrate",
        help="measure early-exit drafting for a model and store the best setting, "
        "or train its drafting head",
    )
    calibrate.add_argument("--model", help="GGUF path or bundled model name")
    calibrate.add_argument("--threads", type=_positive_int, help="CPU threads (default: all)")
    calibrate.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    calibrate.add_argument(
        "--layers", type=_layer_list, help="exit layers to try, comma-separated (default: a sweep)"
    )
    calibrate.add_argument(
        "--train-adapter",
        action="store_true",
        help="also train an exit adapter by self-distillation (a few minutes on a CPU)",
    )
    head = calibrate.add_mutually_exclusive_group()
    head.add_argument(
        "--train-head",
        action="store_true",
        help="train the drafting head on the model's own answers instead (resumable; about "
        "26 minutes on 2 cores for the default model)",
    )
    head.add_argument(
        "--measure-head",
        action="store_true",
        help="measure the trained drafting head again on this machine and engine (a few "
        "minutes): its acceptance, costs and the policy --spec auto uses",
    )
    calibrate.add_argument(
        "--head-form",
        choices=("last", "shallow"),
        default="last",
        help="--train-head/--measure-head: the head on the last layer's state (EAGLE-style, "
        "default) or a block on a shallow exit (Kangaroo-style); --spec auto takes the one "
        "measured faster",
    )
    calibrate.add_argument(
        "--exit-layer",
        type=_positive_int,
        help="--head-form shallow: the exit layer (default: a tenth of the depth)",
    )
    calibrate.add_argument(
        "--head-prompts",
        type=_positive_int,
        default=900,
        help="training answers the head learns from",
    )
    calibrate.add_argument(
        "--head-steps", type=_positive_int, default=3000, help="training steps for the head"
    )
    calibrate.add_argument(
        "--prompts", type=_positive_int, default=8, help="built-in prompts measured (max 8)"
    )
    calibrate.add_argument(
        "--answer-tokens", type=_positive_int, default=96, help="greedy answer length per prompt"
    )
    calibrate.add_argument("--json", action="store_true", help="print one JSON object")

    _add_transcribe_parser(sub)
    _add_gui_parser(sub)
    _add_serve_parser(sub)
    _add_models_parser(sub)
    _add_config_parser(sub)
    return parser


def _add_models_parser(sub) -> None:
    models = sub.add_parser("models", help="the models folder: list, pull, rm, info")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    listing = models_sub.add_parser(
        "list", help="bundled models and the models folder, or a server's (--base-url)"
    )
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.add_argument(
        "--base-url", metavar="URL", help="list an OpenAI-compatible server's models instead"
    )
    listing.add_argument(
        "--api-key", help="that server's key (default: OPENAI_API_KEY or MINIAPP_API_KEY)"
    )
    pull = models_sub.add_parser(
        "pull", help="download one GGUF (and its projector) from Hugging Face"
    )
    pull.add_argument("spec", metavar="REPO[:QUANT]", help="e.g. owner/name:Q4_K_M (default)")
    remove = models_sub.add_parser("rm", help="delete a model from the models folder")
    remove.add_argument("name", help="a file name in the models folder, or a bundled name")
    info = models_sub.add_parser("info", help="GGUF metadata and the chat template")
    info.add_argument("name", help="a GGUF path, a file in the models folder, or a bundled name")
    info.add_argument("--json", action="store_true", help="print JSON")


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible API server (/v1) on the model")
    add_setting_flags(serve, "serve")
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: loopback; others need --api-key)",
    )
    serve.add_argument("--port", type=_port, default=8080, help="port (0: any free one)")
    add_lora_flags(serve, serving=True)
    serve.add_argument(
        "--queue",
        type=_positive_int,
        metavar="N",
        help="requests that may wait for a free slot; more get 503 (default 64)",
    )
    serve.add_argument(
        "--max-models",
        type=_positive_int,
        default=1,
        metavar="N",
        help="models kept loaded at once: a request naming another installed model loads "
        "it, the least recently used going first (default 1)",
    )
    serve.add_argument(
        "--idle-unload",
        type=_positive_float,
        metavar="SECONDS",
        help="unload a model no request has used for this long; the next request loads it "
        "again (default: never)",
    )
    _add_api_flags(serve)


def _add_api_flags(parser: argparse.ArgumentParser) -> None:
    """What the API takes, served alone (`serve`) or beside the GUI (`gui --api`)."""
    parser.add_argument(
        "--chat-template-file",
        metavar="FILE",
        help="a Jinja chat template to use instead of the model's (as llama-server's flag)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("MINIAPP_API_KEY"),
        help="API requests must send Authorization: Bearer KEY (or MINIAPP_API_KEY)",
    )
    parser.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="named keys with quotas (TOML: [keys.NAME] key, requests_per_minute, "
        "tokens_per_minute, max_concurrent); past a quota, 429 with Retry-After",
    )
    parser.add_argument(
        "--request-timeout",
        type=_positive_float,
        metavar="SECONDS",
        help="stop a request still running after this long (504; a stream ends with an error "
        "event) and free its slot (default: none)",
    )
    parser.add_argument(
        "--stall-timeout",
        type=_positive_float,
        default=30.0,
        metavar="SECONDS",
        help="a client that reads none of its stream for this long is dropped, as a "
        "disconnect is, and its slot freed (default 30)",
    )
    parser.add_argument(
        "--breaker-threshold",
        type=_positive_int,
        default=5,
        metavar="N",
        help="after N engine failures in a row, answer 503 at once (the circuit breaker "
        "opens) until a probe request succeeds (default 5)",
    )
    parser.add_argument(
        "--breaker-pause",
        type=_positive_float,
        default=10.0,
        metavar="SECONDS",
        help="how long an open breaker refuses before it lets one probe request through "
        "(default 10)",
    )
    parser.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="send each request's OpenTelemetry spans to this OTLP/HTTP collector, e.g. "
        "http://127.0.0.1:4318/v1/traces (default: no tracing)",
    )
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="json: one JSON line per request on stderr (id, key, status, tokens, timings)",
    )
    parser.add_argument(
        "--max-body-mb",
        type=_positive_float,
        default=50.0,
        metavar="MB",
        help="larger API request bodies get 413 (default 50 MB)",
    )
    parser.add_argument(
        "--pooling",
        choices=POOLING_CHOICES,
        help="/v1/embeddings: how a text's token states are pooled (default: as the GGUF's "
        "pooling_type says, else mean)",
    )
    parser.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let browser pages from ORIGIN call the API (repeatable)",
    )


def add_lora_flags(parser: argparse.ArgumentParser, serving: bool) -> None:
    """LoRA adapters loaded with the model (torch engine: several, picked per request or,
    in the chat, applied to every answer; llama.cpp: one, applied to every answer)."""
    if serving:
        lora_help = (
            "load a LoRA adapter (GGUF) as NAME, at SCALE (default 1); requests pick it by "
            "`model` or `lora` (repeatable)"
        )
        metavar = "NAME=PATH[:SCALE]"
    else:
        lora_help = "answer with this LoRA adapter (GGUF) applied (repeatable)"
        metavar = "PATH"
    parser.add_argument("--lora", action="append", default=[], metavar=metavar, help=lora_help)
    if not serving:
        parser.add_argument(
            "--lora-scale",
            action="append",
            type=float,
            default=[],
            metavar="S",
            help="the scale of the --lora given in the same position (default 1)",
        )
    else:
        parser.add_argument(
            "--lora-dir",
            metavar="DIR",
            help="the folder run-time loads may read adapters from (default: the models "
            "folder's adapters/); paths outside it are refused with 403",
        )
    parser.add_argument(
        "--lora-budget-mb",
        type=_positive_int,
        metavar="MB",
        help="memory the loaded adapters may hold; past it the least recently used are let "
        "go and read again on use (default: no bound)",
    )


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"must be 0..65535, got {value}")
    return value


def _add_gui_parser(sub) -> None:
    gui = sub.add_parser("gui", help="the desktop GUI in your browser (also plain `miniapp`)")
    add_setting_flags(gui, "gui")
    gui.add_argument("--no-browser", action="store_true", help="do not open a browser")
    gui.add_argument(
        "--api", action="store_true", help="also serve the OpenAI-compatible API on the GUI's model"
    )
    gui.add_argument("--api-port", type=_port, default=8080, help="--api: its port (0: any)")
    add_lora_flags(gui, serving=True)
    _add_api_flags(gui)


def _add_config_parser(sub) -> None:
    config = sub.add_parser("config", help="settings: show, set, path")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    config_sub.add_parser("show", help="every setting, its value and where it came from")
    setter = config_sub.add_parser("set", help="store a setting in the config file")
    setter.add_argument("name")
    setter.add_argument("value", nargs="?", help="leave out to go back to the default")
    config_sub.add_parser("path", help="print the config file's path")


def _add_asr_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--asr-model",
        metavar="PATH",
        help="a faster-whisper model folder (default: the bundled whisper tiny.en)",
    )


def _add_asr_eval_parser(eval_sub) -> None:
    asr = eval_sub.add_parser(
        "asr", help="speech recognition on synthetic speech: WER, word times, latency, speed"
    )
    modes = asr.add_mutually_exclusive_group()
    modes.add_argument("--stream", action="store_true", help="only the streaming path")
    modes.add_argument("--offline", action="store_true", help="only offline recognition")
    asr.add_argument(
        "--set",
        choices=("clean", "hard", "wide"),
        default="clean",
        help="sentence set (wide: voices, speeds, pauses and noise never tuned on; scored per "
        "condition, offline and streamed)",
    )
    asr.add_argument("--sentences", type=_positive_int, help="use only the first N sentences")
    _add_asr_model_arg(asr)
    asr.add_argument(
        "--asr-threads",
        type=_positive_int,
        help="CPU threads for recognition (default: --threads, else up to 4)",
    )
    asr.add_argument(
        "--no-answer",
        action="store_true",
        help="skip end of speech -> first answer token (which loads the chat model)",
    )
    _add_model_args(asr, ctx_default=2048)
    _add_kv_type_arg(asr)
    asr.add_argument("--json", action="store_true", help="print one JSON object")


def _add_json_eval_parser(eval_sub) -> None:
    from miniapp.engine.evaluation.json_validity import DEFAULT_MAX_TOKENS

    json_eval = eval_sub.add_parser(
        "json", help="constrained decoding on the bundled JSON schemas: validity and cost"
    )
    json_eval.add_argument(
        "--model", help="GGUF path or bundled model name (default: smollm2-135m-instruct)"
    )
    json_eval.add_argument("--backend", choices=LOCAL_BACKENDS, default="torch")
    json_eval.add_argument(
        "--spec",
        choices=SPEC_MODES,
        default="auto",
        help="speculative decoding for both the constrained and the free answers",
    )
    json_eval.add_argument("--threads", type=_positive_int, help="CPU threads (default: all)")
    json_eval.add_argument("--limit", type=_positive_int, help="only the first K schemas")
    json_eval.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=DEFAULT_MAX_TOKENS,
        help=f"longest answer, with and without the schema (default {DEFAULT_MAX_TOKENS})",
    )
    json_eval.add_argument("--json", action="store_true", help="print one JSON object")


def _add_recall_eval_parser(eval_sub) -> None:
    recall = eval_sub.add_parser(
        "recall",
        help="recall of facts once the KV cache is full: each --kv-policy beside the window "
        "and a full cache, on generated documents (exact match, answer log-probability, "
        "perplexity)",
    )
    # The budgets size the cache: --ctx and --window are refused, --sinks is S.
    _add_model_args(recall, ctx_default=None)
    _add_kv_type_arg(recall)
    recall.add_argument(
        "--budgets",
        default="256,512,1024",
        metavar="LIST",
        help="cache budgets S + W in tokens, comma-separated (default 256,512,1024)",
    )
    recall.add_argument(
        "--depths",
        default="0.1,0.3,0.5,0.7,0.9",
        metavar="LIST",
        help="where the asked fact sits in its document, 0 (start) to 1 (end)",
    )
    recall.add_argument(
        "--lengths",
        default="2,4",
        metavar="LIST",
        help="document lengths as multiples of the budget (default 2,4)",
    )
    recall.add_argument(
        "--cases", type=_positive_int, default=4, help="documents per depth and length"
    )
    recall.add_argument("--seed", type=int, default=0, help="seed of the generated documents")
    recall.add_argument(
        "--policies",
        default="window,attention",
        metavar="LIST",
        help="KV policies compared (window is always among them; the full cache is added)",
    )
    recall.add_argument("--no-ppl", action="store_true", help="skip the perplexity part")
    recall.add_argument(
        "--text", metavar="FILE", help="UTF-8 text for the perplexity (default: generated)"
    )
    recall.add_argument("--json", action="store_true", help="print one JSON object")


def _add_transcribe_parser(sub) -> None:
    transcribe = sub.add_parser("transcribe", help="speech to text, every word with its times")
    transcribe.add_argument("file", help="an audio file (anything FFmpeg reads)")
    transcribe.add_argument(
        "--stream",
        action="store_true",
        help="feed the file in real-time-sized chunks through the streaming path",
    )
    formats = transcribe.add_mutually_exclusive_group()
    for name in ("json", "srt", "vtt"):
        formats.add_argument(
            f"--{name}",
            dest="format",
            action="store_const",
            const=name,
            help=f"print the words as {name.upper()}",
        )
    _add_asr_model_arg(transcribe)
    transcribe.add_argument("--threads", type=_positive_int, help="CPU threads for recognition")
    transcribe.add_argument(
        "--chunk",
        type=_positive_float,
        help="--stream: seconds of audio per streaming step (default: the streaming policy's, 0.3)",
    )
    transcribe.add_argument(
        "--no-refine",
        action="store_true",
        help="keep Whisper's own word edges instead of snapping them to the speech",
    )


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    # A crash inside a native library (llama.cpp, torch, our kernels) cannot be caught, but
    # it is not silent: Python prints the fatal signal and where each thread was.
    faulthandler.enable()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except MiniappError as exc:  # a value the engine checks as it is parsed (--kv-type)
        print(f"miniapp: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(name)s: %(message)s",
    )
    try:
        return _dispatch(args)
    except MiniappError as exc:
        print(f"miniapp: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED


def _dispatch(args: argparse.Namespace) -> int:
    command = args.command or "gui"
    if command == "gui":
        from .gui.server import run_gui

        if args.command is None:  # bare `miniapp`: the GUI with the settings
            args = build_parser().parse_args(["gui"])
        apply_settings(args, "gui")
        return run_gui(args)
    if command == "serve":
        from .serve.run import run_serve

        apply_settings(args, "serve")
        return run_serve(args)
    if command == "chat":
        from .chat import run_chat

        apply_settings(args, "chat")
        return run_chat(args)
    if command == "config":
        from .host.settings import run_config

        return run_config(args)
    if command == "eval":
        from .evaluate import run_asr, run_compare, run_json, run_ppl, run_recall, run_rerank

        handlers = {
            "ppl": run_ppl,
            "compare": run_compare,
            "asr": run_asr,
            "json": run_json,
            "rerank": run_rerank,
            "recall": run_recall,
        }
        return handlers[args.eval_command](args)
    if command == "bench" and args.mode == "lora":
        from .bench_lora import run_bench_lora

        return run_bench_lora(args)
    if command == "bench" and args.mode == "embeddings":
        from .bench_embeddings import run_bench_embeddings

        return run_bench_embeddings(args)
    if command == "bench" and args.mode == "moe":
        from .bench_moe import run_bench_moe

        return run_bench_moe(args)
    if command == "bench" and args.mode == "serve":
        from .bench_serve import run_bench_serve

        return run_bench_serve(args)
    if command == "bench":
        from .bench import run_bench

        return run_bench(args)
    if command == "doctor":
        from .doctor import run_doctor

        return run_doctor(args)
    if command == "calibrate":
        from .calibrate import run_calibrate

        return run_calibrate(args)
    if command == "models":
        from .models_cmd import run_models

        return run_models(args)
    if command == "transcribe":
        from .transcribe import run_transcribe

        return run_transcribe(args)
    raise AssertionError(command)


if __name__ == "__main__":
    sys.exit(main())
