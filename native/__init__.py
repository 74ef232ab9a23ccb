"""Our own compute kernels, each beside a pure-torch reference and a test that they agree.

Empty for now: the engine uses torch's int4 kernels until one of ours measures faster.
"""
