"""Measuring the engine, apart from inference: benchmarks (`benchmark`), perplexity and
agreement with llama.cpp (`perplexity`), speech recognition scores (`asr_benchmark`), and the
early-exit calibration (`calibrate`). These import the engine; the engine never imports them.
"""
