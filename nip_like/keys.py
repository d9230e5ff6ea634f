"""The TensorDict keys of the multi-agent layout, in one place.

Environments write these entries, agent networks read and write them, and
losses read them. Keeping them here lets a loss depend on the layout alone,
not on the agent networks. Per-agent entries live in the ``"agents"``
sub-TensorDict, whose last batch dimension is the agent dimension; the docs'
"TensorDict keys" page gives every key with its shape.
"""

from __future__ import annotations

#: What each agent observes, ``(*batch, agents, features)``.
OBSERVATION_KEY = ("agents", "observation")
#: The action each agent took, ``(*batch, agents)``.
ACTION_KEY = ("agents", "action")
#: Which actions are legal for each agent, ``(*batch, agents, actions)``.
ACTION_MASK_KEY = ("agents", "action_mask")
#: The policy's logits at collection, ``(*batch, agents, actions)``.
LOGITS_KEY = ("agents", "logits")
#: The log-probability of the action at collection, ``(*batch, agents)``.
LOG_PROB_KEY = ("agents", "action_log_prob")
#: The critic's value estimate, ``(*batch, agents, 1)``.
VALUE_KEY = ("agents", "state_value")
#: Who acts in this step, ``(*batch, agents)`` booleans.
ACTIVE_KEY = ("agents", "active")
#: The step's reward (under ``"next"``), ``(*batch, agents, 1)``.
REWARD_KEY = ("agents", "reward")
#: Episode over, per agent (under ``"next"``), ``(*batch, agents, 1)``.
DONE_KEY = ("agents", "done")
#: Same as done: episodes end by termination only.
TERMINATED_KEY = ("agents", "terminated")
#: Advantage written by an advantage module, ``(*batch, agents, 1)``.
ADVANTAGE_KEY = ("agents", "advantage")
#: Value target written by an advantage module, ``(*batch, agents, 1)``.
VALUE_TARGET_KEY = ("agents", "value_target")
#: Sum of the agent's rewards so far in the episode, ``(*batch, agents, 1)``.
EPISODE_RETURN_KEY = ("agents", "episode_return")
#: Round (step number) of the episode, ``(*batch,)``.
ROUND_KEY = ("state", "round")
#: Which group of side-by-side episodes (same datapoint) a step belongs to, ``(*batch,)``.
GROUP_ID_KEY = ("state", "group_id")

# Token-sequence actions (language-model agents): ``T`` is the message length.
#: Each agent's prompt tokens, ``(*batch, agents, P)`` long.
PROMPT_IDS_KEY = ("agents", "prompt_ids")
#: The prompt's real tokens, ``(*batch, agents, P)`` bool.
PROMPT_MASK_KEY = ("agents", "prompt_mask")
#: The message's real tokens, ``(*batch, agents, T)`` bool (the action is then ``(*batch, agents, T)``).
TOKEN_MASK_KEY = ("agents", "token_mask")
#: Each sampled token's log-probability at collection, ``(*batch, agents, T)``.
TOKEN_LOG_PROBS_KEY = ("agents", "token_log_probs")
#: The entropy of the distribution each token was drawn from, ``(*batch, agents, T)``.
TOKEN_ENTROPY_KEY = ("agents", "token_entropy")
#: Truncated importance weight of each token sampled by an inference server, ``(*batch, agents, T)``
#: (``min(pi_trainer / pi_server, c)``, 1 elsewhere); present only when a server sampler sets ``max_importance_weight``.
SAMPLER_WEIGHT_KEY = ("agents", "sampler_weight")
#: The version of the pooled agent each step's episode meets (``trainer.opponent_pool``), ``(*batch,)``: -1 for the
#: agent itself, else the snapshot's version; present only with an opponent pool.
OPPONENT_VERSION_KEY = "opponent_version"
