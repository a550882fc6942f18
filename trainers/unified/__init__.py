"""The unified model: one transformer backbone with a text head and a flow head, and
its two trainers (registered as ``unified_pretrain`` and ``unified``).

- :mod:`.model`: the model and its checkpoints, with a TinyLM view and a FlowDiT view
- :mod:`.base`: settings, two-track data, evaluation and state both trainers share
- :mod:`.pretrain`: supervised pretraining of both tracks (SFT + flow matching)
- :mod:`.rl`: GRPO on the text track and Flow-GRPO on the image track, one update
"""

from trainers.unified.pretrain import UnifiedPretrainConfig, UnifiedPretrainTrainer
from trainers.unified.rl import UnifiedConfig, UnifiedTrainer

__all__ = ["UnifiedConfig", "UnifiedPretrainConfig", "UnifiedPretrainTrainer", "UnifiedTrainer"]
