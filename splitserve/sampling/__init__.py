"""What a request asks of generation, shared by the router, the worker front end and the engine:
sampling parameters and grammar specs (params.py), whether a grammar spec parses (grammar_check.py), stop
strings (stop_strings.py) and token log-probabilities (logprobs.py). No torch, engine, model or transport
code: the router imports these without loading the engine."""
