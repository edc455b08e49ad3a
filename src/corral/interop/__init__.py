"""Other tools' configuration files, read: ``.deepspeed_env``, accelerate
configs, DeepSpeed JSON configs.  Parsers only (no launch machinery), so
that ``corral.run`` can use them; writing other tools' files is
``corral.export``, which sits above ``corral.run`` and reuses its plan."""
