"""kvgate's bundled engine simulator: a vLLM/SGLang look-alike with real queues, batches and a prefix cache.

`engine.Engine` is the core (usable on a virtual clock, without HTTP); `server` puts the OpenAI API in
front of it; `cli.main` parses `vllm serve`-style flags. See `cli.py` for the flags and `faults.py` for
`x-sim-fault`.
"""
