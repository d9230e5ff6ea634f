"""Text agents: text models behind one interface, rollouts of chat games, fine-tune jobs."""
