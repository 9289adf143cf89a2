"""The `crucible` subcommands, one module per command, named after it.

Each module exposes `add_arguments(parser)` and `run(args) -> int` and imports nothing heavy
(torch, numpy, tokenizers) at import time, so `crucible --help` stays fast; `crucible.trainer.cli`
registers them in its COMMANDS table. The work itself lives in the packages they call (`loop`,
`plan`, `corpus`, `tokenizer`, `guard`); these modules parse flags, print results and turn bad
input into `cli.UserError`.
"""
