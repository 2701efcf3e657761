"""The fake's ``sglang.srt``: the modules the adapter imports, at SGLang 0.5.3's paths."""
