"""Everything that plugs into SGLang, in one package.

    compat.py            the supported SGLang range; `Hook` and the all-or-nothing install
    components.py        the registries we fill (model, attention backend, radix cache, server
                         defaults, quantization method)
    hooks/               one file per hooked SGLang function (body, target, signature, why)
    server_defaults.py   DeepSeek-V4 server settings: declared defaults, refusals naming the flag
    request_guard.py     request validation at the HTTP / tokenizer boundary (used by the hooks)

The entry points SGLang calls stay where the installed metadata names them: `plugin.register`
(runs components, then hooks) and `platforms.activate` (the CPU reference platform).
"""
