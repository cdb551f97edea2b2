"""An axolotl plugin that gives the Trainer back its token count, until axolotl-ai-cloud/axolotl#3982 lands: axolotl
0.19.0's trainer sets ``model_accepts_loss_kwargs = False`` for every model whose ``forward`` does not name
``num_items_in_batch`` (transformers' models take it through ``**kwargs``), and its builder sets
``average_tokens_across_devices = False``; the step is then the mean of the micro-batch means. This plugin sets both
back once the trainer is built, so the loss is the mean over the global batch's label tokens, as transformers means
it. In the config:

    plugins:
      - gradkit_axolotl_fix.TokenMean     # this file on the ranks' path (PYTHONPATH, or installed)

``tests/test_recipes.py`` measures it with gradkit's watch: the rows that are affected without it are not with it.
"""
from axolotl.integrations.base import BasePlugin


class TokenMean(BasePlugin):
    def add_callbacks_post_trainer(self, cfg, trainer):
        trainer.model_accepts_loss_kwargs = True  # the model divides by the window's label tokens it is given
        trainer.args.average_tokens_across_devices = True  # ... counted over every rank
        return []
