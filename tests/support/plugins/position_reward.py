"""A reward function for the plugin run (tests/e2e/test_plugins_e2e.py): rewards that differ within every group
whatever the model answers (the tiny test model often gives one prompt's responses alike): each sample's position
in the call, modulo 3, so that every group has advantages to learn from."""


def position_mod_3(prompts, responses, ground_truths, data_sources, extra, **kwargs):
    return [float(i % 3) for i in range(len(responses))]
