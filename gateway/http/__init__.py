"""The data plane's client-facing surface: the aiohttp app and its routes (inference, the model
list, the tokenizer), the envelope every inference request gets (its record, its answer or its
error in the OpenAI form), client connection limits, bounded body reading and bearer keys.

May import: path, admission, routing, fleet and the base modules (config, errors, logs).
Never control or observe: their routes and handles are given to it by the composition root.
"""
