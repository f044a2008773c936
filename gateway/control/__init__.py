"""Operating a running gateway: the admin API, config reload, state shared between gateway
instances, rollout statistics and the `kvgate rollout` command.

May import: path, admission, routing, fleet and the base modules; never http or observe.
"""
