"""Where a request goes: the model catalog (what a client's `model` names, by the endpoint's task;
the model list), the rollouts (route -> pool), each pool's router (features, candidates, ranking by
the policy plugin, learning), LoRA adapters as routing facts (and their loads on demand), prefix
indexes, KV events and precise prefix mode.

May import: prompt, fleet and the base modules.
"""
