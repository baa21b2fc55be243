"""The DALI backend of the training views (``data.backend=dali``): loader workers draw each
view's parameters without decoding (:mod:`.params`); the main process decodes and crops
with NVIDIA DALI on the run's device and applies the colour steps there (:mod:`.device`,
:mod:`.colour`)."""
