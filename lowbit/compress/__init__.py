"""Compression methods: calibration, statistics, GPTQ, AWQ, outlier selection, the layer pipeline,
recipes and `lowbit inspect`, written against the number formats of lowbit/quant/.

Options travel typed (compress/options.py): `MethodOptions` groups `CalibrationSource`,
`GptqOptions` and `OutlierOptions`, built and validated once by cli/quantize_cmd.py.

Quantizing a whole model (compress/pipeline.py, compress/methods.py, compress/recipe.py)
-------------------------------------------------------------------------------
`quantize_model(model, spec_or_recipe, out_dir=, method="rtn", skip=[], quantize_head=False,
overwrite=False, method_options: MethodOptions | None = None, progress=None) -> QuantizeSummary` walks a float checkpoint
part by part (embeddings, decoder layers in order, final norm + lm_head), reading tensors lazily,
and streams lowbit's native checkpoint out with NativeWriter (atomic). Which module gets which
format comes from a `Recipe` (ordered {pattern, format, group_size, options} rules, first match
wins; `load_recipe(path)` reads YAML/JSON) or one format for all; `skip` patterns stay dense.

The method hook: a method is registered by name (`methods.register_method(name, factory)`, or a
module listed in `methods.METHOD_MODULES` that defines `make_layer_method(context)`). The factory
gets a `MethodContext` (method name, model_dir, config, num_layers, options: the run's `MethodOptions`, compress/options.py)
once per run and returns `layer_method(work: LayerWork) -> LayerResult`, called for each part in
order. `LayerWork` holds the part's stored tensors by HF name (`work.weight(module)` gives float32),
`specs` (module -> FormatSpec to produce), `fused` (modules sharing an input: q/k/v, gate/up) and
`global_scales` (nvfp4's shared scale per module, already computed — pass it on to quantize).
`LayerResult` returns one QTensor per module in `specs`, optional replaced dense tensors of the
part (AWQ's folded norms) and notes for the summary. `methods.rtn_layer` is the reference method;
a calibrated method keeps its own state (activations, statistics) in the closure.

`checkpoint_report.inspect_checkpoint(path, base=None)` is `lowbit inspect`.
"""
