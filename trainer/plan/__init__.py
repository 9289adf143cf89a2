"""Planning: compute-optimal budgets, memory and parallelism, checkpoint interval, cost, a review
of a training config, and the pretrain / continue / fine-tune strategy.

Pure functions with dataclass results, one concept per module:
- `quantities`  parse `1.3B`, `20T`, `6e23` and print SI figures;
- `scaling`     Chinchilla (Hoffmann et al. 2022) with the Besiroglu et al. 2024 refit, the
                20 tokens/parameter rule, Kaplan et al. 2020, inference-aware sizing (Sardana);
- `precision`   bytes a parameter each precision keeps (mixed, stochastic rounding, pure bf16,
                fp32) and FSDP's reduce dtype;
- `memory`      per-GPU bytes for DDP and ZeRO-1/2/3 (Rajbhandari et al. 2020) and activations
                (Korthikanti et al. 2022);
- `parallelism` layouts, pipeline bubble and communication volumes (Narayanan et al. 2021);
- `reliability` checkpoint interval from MTBF (Young 1974, Daly 2006), lost work, goodput;
- `cost`        wall-clock, GPU-hours and money at an assumed MFU;
- `recipes`     published training recipes (GPT-3 Table 2.1, torchtitan Llama 3 flavours);
- `planner`     puts the above together for `crucible plan`; `emit_job` emits a PretrainJob;
- `configs`     reads a PretrainJob, torchtitan TOML or nanoGPT config; `review` judges it;
- `strategy`    pretrain vs continued pretraining vs fine-tuning (`crucible decide`);
- `report`      figures with unit, formula and source, rendered as a table or JSON.

Torch-free and I/O-free except `configs` (reads a file). The operator does not import it: the
planes meet only in `crucible.api`. The commands that print plans live in
`crucible.trainer.commands`.
"""
