"""DeepSpeed interop: its checkpoints of a GPT (ZeRO-1/2/3, PipelineModule, universal) turned into ours, and our
GPT as a DeepSpeed PipelineModule (`pipeline_gpt`, for DeepSpeed's side of tests and benchmarks).

- `safe`: DeepSpeed's pickles read with torch's weights-only unpickler and inert stand-ins (nothing runs);
- `read`: the checkpoint's files -> `DeepSpeedState` (fp32 weights, Adam moments and steps by its names);
- `names`: those names (ours, Hugging Face GPT-2's, the pipeline's) -> our GPT's, shapes checked;
- `convert`: the settings it fixes, the trajectory checks, and the write of our checkpoint.
DeepSpeed itself is not needed: only torch.
"""

from elastic_trainer.interop.deepspeed.convert import ImportPlan, check_settings, import_deepspeed, settings_of
from elastic_trainer.interop.deepspeed.names import TIED_KEY, gpt_shapes, pipeline_param_name, to_gpt
from elastic_trainer.interop.deepspeed.read import DeepSpeedState, ParamState, read_deepspeed, tag_folder
from elastic_trainer.interop.deepspeed.safe import STAND_INS, safe_load

__all__ = [
    "DeepSpeedState",
    "ImportPlan",
    "ParamState",
    "STAND_INS",
    "TIED_KEY",
    "check_settings",
    "gpt_shapes",
    "import_deepspeed",
    "pipeline_param_name",
    "read_deepspeed",
    "safe_load",
    "settings_of",
    "tag_folder",
    "to_gpt",
]
