"""`miniapp doctor`: what this machine offers miniapp, and which path a model would take."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from miniapp.engine.api import (
    AdapterError,
    GGUFFile,
    plan_torch_cache_and_device,
    read_adapter,
    resolve_model,
)
from miniapp.engine.kv.footprint import estimate_footprint
from miniapp.engine.kv.types import KV_SETTING_NAMES, kv_type
from miniapp.engine.platform.cpu_features import cpu_features
from miniapp.engine.platform.devices import (
    GIB,
    decode_step_path,
    default_probe,
)
from miniapp.engine.platform.kernels import (
    cpu_attention_kernel,
    cpu_int4_kernel,
    describe_ggml_kernel,
)

KIB, MIB = 1024, 2**20


def run_doctor(args: argparse.Namespace) -> int:
    probe = default_probe()
    gpus = probe.gpus()
    model = resolve_model(args.model)
    gguf = GGUFFile(model)
    # The cache type and plan the torch engine would take: --kv-type, else its default for
    # the device (bf16 on a GPU that holds the model and the cache, q8 otherwise).
    asked = None if args.kv_type is None else kv_type(args.kv_type)
    cpu_moe = getattr(args, "cpu_moe", False)
    kind, plan = plan_torch_cache_and_device(gguf, args.ctx, args.device, probe, asked, cpu_moe)
    footprint = estimate_footprint(gguf, args.ctx, kind)  # its KV as that type stores it
    cpu, int4_kernel, attention = cpu_features(), cpu_int4_kernel(), cpu_attention_kernel()
    report = {
        "versions": probe.versions(),
        "cpu": {
            **cpu.summary(),
            "summary": cpu.describe(),
            # The path each of our native kernels takes here (None: torch's op instead).
            "native_int4": int4_kernel.library.isa_name if int4_kernel.native else None,
            "native_attention": "avx2" if attention else None,
        },
        "gpus": [asdict(g) for g in gpus],
        "kernels": {
            "cpu": asdict(probe.check_int4(None)),
            **{g.label: asdict(probe.check_int4(g)) for g in gpus},
        },
        "cpu_int4_kernel": int4_kernel.describe(),
        "cpu_ggml_kernel": describe_ggml_kernel(),
        "cpu_attention": "native (AVX2)" if attention else "torch (scaled_dot_product_attention)",
        "model": str(model),
        "footprint": asdict(footprint),
        "kv_cache": {
            **_kv_cache_report(gguf, kind, args.ctx, footprint.kv_bytes),
            "why": _kv_choice(kind, asked, plan, probe),
        },
        "plan": asdict(plan),
        "decode_step": decode_step_path(
            probe, plan, footprint.n_layers, footprint.expert_int4_bytes > 0
        )[1],
        "llama_cpp": _llama_cpp_report(probe, footprint),
        "audio_inputs": _audio_inputs(),
        "lora": [_adapter_report(gguf, Path(path)) for path in getattr(args, "lora", [])],
        "experts": {
            "count": gguf.arch_value("expert_count") or 0,
            "used": gguf.arch_value("expert_used_count") or 0,
        },
    }
    if args.json:
        print(json.dumps(report))
    else:
        _print_report(report)
    return 0


def _adapter_report(gguf: GGUFFile, path: Path) -> dict:
    """A LoRA adapter checked against the model: what it holds, what it costs to load and
    keep (the torch engine keeps its tensors as stored), or the one line refusing it."""
    start = time.perf_counter()
    try:
        adapter = read_adapter(path, gguf)
    except AdapterError as exc:
        return {"path": str(path), "error": str(exc)}
    seconds = time.perf_counter() - start
    return {
        "path": str(path),
        "rank": adapter.rank,
        "alpha": adapter.alpha,
        "weights": len(adapter.pairs),
        "bytes": adapter.nbytes,
        "read_seconds": seconds,
        "llama_cpp_reads_it": not adapter.from_f64,
    }


def _kv_cache_report(gguf: GGUFFile, kind, ctx: int, bytes_at_ctx: int) -> dict:
    """The KV cache of the chosen type, and a token's bytes in each type (every layer)."""
    per_type = {
        name: estimate_footprint(gguf, 1, kv_type(name)).kv_bytes for name in KV_SETTING_NAMES
    }
    per_token = estimate_footprint(gguf, 1, kind).kv_bytes
    return {
        "type": kind.name,
        "bytes_per_token": per_token,
        "ctx": ctx,
        "bytes_at_ctx": bytes_at_ctx,
        "per_type": per_type,
    }


def _kv_choice(kind, asked, plan, probe) -> str:
    """Why the cache has this type (plan_torch_cache_and_device chose it)."""
    if asked is not None:
        return "as --kv-type says"
    if plan.on_gpu and kind.name == "bf16":
        return "the default on a GPU that holds the model and this cache: SDPA reads it as stored"
    if plan.on_gpu and probe.torch_device(plan) != "cpu":
        return "the default where a bf16 cache would not fit beside the model on the GPU"
    return (
        f"the default on the CPU (a simulated GPU's too), whose attention reads {kind.name} as is"
    )


def _size(nbytes: float) -> str:
    if nbytes >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / MIB:.1f} MiB" if nbytes >= MIB else f"{nbytes / KIB:.1f} KiB"


def _llama_cpp_report(probe, footprint) -> dict:
    from miniapp.engine.llamacpp.library import (
        build_features,
        cpu_path,
        llama_cpp,
        llama_supports_gpu_offload,
    )
    from miniapp.engine.platform.devices import plan_llamacpp_offload

    supported = llama_supports_gpu_offload()
    offload = plan_llamacpp_offload(supported, probe, footprint)
    path = cpu_path()
    return {
        "version": llama_cpp.__version__,
        "gpu_offload": supported,
        "n_gpu_layers": offload.gpu_layers,
        "reason": offload.reason,
        # What the build was compiled with ("AVX512": "1", "AMX_INT8": "1", "REPACK": "1"...)
        # and how weights are laid out on the CPU (extra buffer types: CPU_REPACK, AMX).
        "build": build_features(),
        "cpu_weights": {**asdict(path), "summary": path.describe()},
    }


def _audio_inputs() -> dict:
    """Microphones, as sounddevice (PortAudio) lists them."""
    try:
        import sounddevice
    except ImportError:
        return {"devices": [], "error": "sounddevice is not installed (voice input needs it)"}
    except OSError as exc:  # the package is there, the PortAudio library is not
        return {"devices": [], "error": f"PortAudio is missing: {exc}"}
    try:
        devices = sounddevice.query_devices()
    except sounddevice.PortAudioError as exc:
        return {"devices": [], "error": str(exc)}
    inputs = [d["name"] for d in devices if d.get("max_input_channels", 0) > 0]
    return {"devices": inputs, "error": None if inputs else "no input device found"}


def _print_report(report: dict) -> None:
    versions = report["versions"]
    print(
        f"torch {versions['torch']}, CUDA {versions['cuda'] or 'none'}, "
        f"HIP {versions['hip'] or 'none'}"
    )
    print(f"CPU: {report['cpu']['summary']}")
    if not report["gpus"]:
        print("GPUs: none visible to torch")
    for gpu in report["gpus"]:
        detail = gpu["arch"] or (".".join(map(str, gpu["capability"])) if gpu["capability"] else "")
        print(
            f"GPU {gpu['backend']}:{gpu['index']}: {gpu['name']} {detail}, "
            f"{gpu['free_bytes'] / GIB:.1f} of {gpu['total_bytes'] / GIB:.1f} GiB free"
        )
    for where, check in report["kernels"].items():
        state = "OK" if check["ok"] else "unavailable"
        print(f"int4 kernel on {where}: {state} ({check['reason']})")
    print(f"int4 matmul on the CPU: {report['cpu_int4_kernel']}")
    print(f"GGML block matmul on the CPU: {report['cpu_ggml_kernel']}")
    print(f"decode attention on the CPU: {report['cpu_attention']}")
    plan, footprint, kv = report["plan"], report["footprint"], report["kv_cache"]
    print(
        f"model {report['model']}: weights {footprint['int4_bytes'] / GIB:.2f} GiB as packed, "
        f"{footprint['bf16_bytes'] / GIB:.2f} GiB as bf16, KV {footprint['kv_bytes'] / GIB:.2f} GiB"
    )
    if footprint["expert_int4_bytes"]:
        experts = report["experts"]
        print(
            f"mixture of experts: {experts['used']} of {experts['count']} experts a token; "
            f"the experts are {footprint['expert_int4_bytes'] / GIB:.2f} GiB of the weights, "
            f"{'on the CPU' if plan['experts_on_cpu'] else 'with the rest of each layer'}"
        )
    f32 = kv["per_type"]["f32"]
    versus = f" (f32: {f32 / KIB:.1f} KiB a token)" if kv["type"] != "f32" else ""
    print(
        f"KV cache: {kv['type']}, {kv['bytes_per_token'] / KIB:.1f} KiB a token, "
        f"{_size(kv['bytes_at_ctx'])} at {kv['ctx']} tokens{versus} - {kv['why']}"
    )
    layers = f", {plan['gpu_layers']} layers on the GPU" if plan["device"] != "cpu" else ""
    print(
        f"chosen path: {plan['device']} with {plan['weights']} weights{layers} - {plan['reason']}"
    )
    for fallback in plan["fallbacks"]:
        print(f"  fell back from {fallback['step']}: {fallback['reason']}")
    print(f"decode step: {report['decode_step']}")
    llama = report["llama_cpp"]
    print(
        f"llama.cpp {llama['version']}: GPU offload {'yes' if llama['gpu_offload'] else 'no'}; "
        f"n_gpu_layers {llama['n_gpu_layers']} ({llama['reason']})"
    )
    built = [
        name
        for name in ("AVX2", "AVX512", "AVX512_BF16", "AMX_INT8")
        if llama["build"].get(name) == "1"
    ]
    print(
        f"llama.cpp built with {', '.join(built) or 'none of AVX2, AVX512, AMX'}; "
        f"weights on the CPU: {llama['cpu_weights']['summary']}"
    )
    audio = report["audio_inputs"]
    print(f"audio inputs: {', '.join(audio['devices']) if audio['devices'] else audio['error']}")
    for adapter in report["lora"]:
        if "error" in adapter:
            print(f"LoRA adapter: {adapter['error']}")
            continue
        llama = (
            "" if adapter["llama_cpp_reads_it"] else "; F64 tensors: llama.cpp would crash on it"
        )
        print(
            f"LoRA adapter {adapter['path']}: rank {adapter['rank']} on {adapter['weights']} "
            f"weights, {_size(adapter['bytes'])} kept, read and checked in "
            f"{adapter['read_seconds'] * 1000:.0f} ms{llama}"
        )
