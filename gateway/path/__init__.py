"""One inference request's path: the request object and its preparation, admission and
dispatch (proxy), the prefill/decode hand-off, claims on replicas, what of a client's request
may reach engines, the answer's model name and SSE events, the tokenizer endpoints' calls, and how
bytes move to engines (upstream, transports).

May import: admission, routing, fleet and the base modules. Tracing and observers come in
through the narrow protocols in `path.trace` and `path.request_record`.
"""
