"""A weightsync receiver held inside an inference engine's workers: what every engine
adapter (``receiver/vllm``, ``receiver/sglang``) shares. The probe-recorded layout map
(``layout.py``), the layer kinds and each engine's ``Rules`` (``kinds.py``), the
permutation discovery (``permute.py``), the per-step versions (``steps.py``), the safe
reload path's bookkeeping (``reload.py``) and the held worker with its in-window commit
(``worker.py``). An engine's own folder holds only what is its own: its entry points and
its ``EngineSide`` (rules, reload, worker group)."""
