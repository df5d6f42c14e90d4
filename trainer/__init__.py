"""rollway's trainer: leases complete groups from the gateway, trains with FSDP2, publishes HF weights.

Entry points:
    trainer.launch.main(argv) -> int     `rollway train ...`: validates the config, runs torchrun
    trainer.train.main(argv)             one torchrun worker (`python -m trainer.train --config FILE`)
    trainer.config.load_config(path, overrides) -> TrainConfig

Modules: config, client (gateway HTTP), advantages, loss, batching, fsdp, step, checkpoint, train, sft,
metrics, plot, launch.
"""
