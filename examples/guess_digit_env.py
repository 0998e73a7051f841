"""The environment of configs/grpo_guess_digit.yaml: a guessing game the model learns to play from the answers it
gets. The prompts file's ``secret`` column holds a digit the prompt does not show; each turn the model guesses (the
first digit of its turn) and the environment answers `` higher`` or `` lower`` until the guess is right, which pays
1 at the first turn and a quarter less at each later one; a turn without a digit costs 0.1. A player that ignores
the answers makes 0.25 a game at best (four different fixed guesses); one that halves the range each turn (a
binary search) makes 0.525."""


class GuessDigit:
    """One game: ``reset`` takes the row's secret digit, ``step`` answers a turn of the model."""

    def reset(self, prompt, secret, **columns):
        """A new game for ``secret``; the prompt says all there is to say (nothing added)."""
        self.secret, self.turns = int(secret), 0
        return None

    def step(self, completion):
        """``(text, reward, done)`` for the model's turn: its first digit is the guess."""
        self.turns += 1
        guess = next((int(c) for c in completion if c.isdigit()), None)
        if guess is None:  # not a move: a small penalty, which a player that always guesses never pays
            return " a digit?\n", -0.1, False
        if guess == self.secret:
            return "", 1.0 - 0.25 * (self.turns - 1), True
        return (" higher\n" if guess < self.secret else " lower\n"), 0.0, False
