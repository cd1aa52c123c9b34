"""The babilong world simulator: the answers come from the simulated state, and the story alone says
the same (read back by an independent parser); answer extraction and interleaving."""

from __future__ import annotations

import random

import pytest

from bench.harness.world import (
    COUNT_WORDS,
    ROOMS,
    Task,
    extract,
    interleave,
    is_correct,
    make_task,
    replay,
    simulate,
)


def test_a_hand_written_story_is_read_back_right() -> None:
    story = ["Mary went to the kitchen.", "John moved to the garden.", "Mary picked up the apple.",
             "Mary travelled to the office.", "Mary dropped the apple.", "John got the milk.",
             "John journeyed to the hallway.", "Mary grabbed the apple.", "Mary went to the bedroom."]
    w = replay(story)
    assert w.where == {"Mary": "bedroom", "John": "hallway"}
    assert w.object_room("apple") == "bedroom"  # carried by Mary
    assert w.object_room("milk") == "hallway"  # carried by John
    assert w.carrying("Mary") == 1 and w.carrying("John") == 1


def test_a_dropped_object_stays_where_it_was_dropped() -> None:
    w = replay(["Sandra went to the garden.", "Sandra got the football.", "Sandra put down the football.",
                "Sandra moved to the office."])
    assert w.object_room("football") == "garden"
    assert w.carrying("Sandra") == 0


@pytest.mark.parametrize("seed", range(40))
def test_simulated_state_equals_the_story_read_back(seed: int) -> None:
    story, world = simulate(random.Random(seed), 14)
    back = replay(story)
    assert back.where == world.where
    assert back.holder == world.holder
    assert back.placed == world.placed


@pytest.mark.parametrize("kind", ["where_person", "where_object", "count"])
def test_task_answers_follow_the_story(kind: str) -> None:
    rng = random.Random(kind)
    for _ in range(30):
        task = make_task(rng, 10, kind)  # type: ignore[arg-type]
        w = replay(task.story)
        if task.kind == "where_person":
            person = task.question.split()[-1].rstrip("?")
            assert task.answer == w.where[person]
        elif task.kind == "where_object":
            obj = task.question.split()[-1].rstrip("?")
            assert task.answer == w.object_room(obj)
        else:
            person = task.question.split()[4]
            assert task.answer == COUNT_WORDS[w.carrying(person)]
        assert task.answer in ROOMS or task.answer in COUNT_WORDS


def test_every_person_is_placed_before_objects_are_handled() -> None:
    story, _ = simulate(random.Random(3), 12, people=3)
    assert all(" to the " in s for s in story[:3])


def test_extract_and_exact_match() -> None:
    where = Task([], "Where is Mary?", "kitchen", "where_person")
    assert is_correct("Mary is in the kitchen.", where)
    assert is_correct("kitchen", where)
    assert not is_correct("She left the kitchen for the garden", Task([], "Where is Mary?", "garden", "where_person"))
    assert not is_correct("I don't know.", where)
    count = Task([], "How many objects is John carrying?", "two", "count")
    assert is_correct("John is carrying 2 objects.", count)
    assert is_correct("Two.", count)
    assert not is_correct("one", count)
    assert extract("none at all", "count") == "none"
    assert extract("He is carrying nothing.", "count") == "none"


def test_interleave_keeps_story_order_and_all_filler() -> None:
    story = [f"s{i}" for i in range(5)]
    filler = [f"f{i}" for i in range(50)]
    out = interleave(story, filler, random.Random(1))
    assert [x for x in out if x.startswith("s")] == story
    assert [x for x in out if x.startswith("f")] == filler
    assert interleave(story, [], random.Random(1)) == story


def test_replay_refuses_a_foreign_sentence() -> None:
    with pytest.raises(ValueError, match="not a world sentence"):
        replay(["The committee admired the distant hills before the rain began."])


def test_a_prompt_as_sent_still_answers_its_question() -> None:
    from bench.harness.haystack import filler_sentences
    from bench.harness.scenarios.babilong import prompt
    from bench.harness.world import answer_from_text

    rng = random.Random(9)
    changed = 0
    for i in range(30):
        task = make_task(rng, 10, ["where_person", "where_object", "count"][i % 3])  # type: ignore[arg-type]
        text = prompt(task, 40, i)
        assert answer_from_text(text, task.question) == task.answer
        assert all(s not in " ".join(filler_sentences(40, i)) for s in task.story)
        cut = text.replace(task.story[-1], "")  # a prompt that lost its last event
        changed += answer_from_text(cut, task.question) != task.answer
    assert changed > 0  # the check can fail


def test_answer_of_refuses_other_questions() -> None:
    from bench.harness.world import World, answer_of

    with pytest.raises(ValueError, match="not a world question"):
        answer_of(World(), "What is the pass key?")
    assert answer_of(World(), "Where is Mary?") is None
