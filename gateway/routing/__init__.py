"""Where a request goes: the model catalog (what a client's `model` names, by the endpoint's task;
the model list), the rollout router (route -> pool), each pool's router (features, candidates,
ranking by the policy plugin, learning), LoRA adapters as routing facts (and their loads on demand),
prefix hashing and indexes, KV events, precise prefix mode, canonicalization and token counting.

May import: fleet and the base modules.
"""
