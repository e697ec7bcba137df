"""Where the numbers go: the epoch-end report that calls the metrics and hands results on (:mod:`.report`), heatmaps
and head grids (:mod:`.images`, :mod:`.figures`, :mod:`.figure_cache`, :mod:`.text_outlines`), TensorBoard tags
and the custom-scalars layout (:mod:`.dashboard`), the loggers and the background image writer (:mod:`.writer`), PNG
encoding (:mod:`.png`), the optional drawing process (:mod:`.drawing`; its side, torch-free: :mod:`.draw_worker`),
the export format and the callback's export files (:mod:`.export`, :mod:`.epoch_files`) and the Attention tab's
files (:mod:`.explore`, written in the format of :mod:`attn_callbacks.explorer.data`). May import every other part;
nothing imports it but the callback and the CLI."""
