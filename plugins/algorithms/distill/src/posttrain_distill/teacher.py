"""Checks on the teacher, on the driver, before any worker starts."""

from __future__ import annotations

from typing import Any

from posttrain.config import where_set
from posttrain.data.chat import load_tokenizer
from posttrain.errors import ConfigError
from posttrain.models.folder import check_vocab_fits, read_model_config, require_weights


def check_teacher(config: Any) -> None:
    """Refuse a teacher folder that is not a model, or whose tokenizer differs from the
    student's: the loss compares the two next-token distributions id by id, so both models
    must number tokens the same way. Raises :class:`ConfigError` naming the key, both
    tokenizers and the first token on which they differ."""
    teacher = config.section("distill").teacher
    model_config = read_model_config(teacher.model, "distill.teacher.model")
    require_weights(teacher.model, "distill.teacher.model")
    student_key = "policy.tokenizer" if config.policy.tokenizer else "policy.model"
    teacher_key = "distill.teacher.tokenizer" if teacher.tokenizer else "distill.teacher.model"
    student_path = config.policy.tokenizer or config.policy.model
    teacher_path = teacher.tokenizer or teacher.model
    student, other = load_tokenizer(student_path).get_vocab(), load_tokenizer(teacher_path).get_vocab()
    if student != other:
        raise ConfigError(
            f"{teacher_key}: the teacher's tokenizer ('{teacher_path}') differs from the student's ('{student_path}', "
            f"{student_key}): {_first_difference(student, other)}. On-policy distillation compares the teacher's and "
            "the student's next-token distributions token id by token id, so the teacher must use the student's "
            "tokenizer: choose a teacher of the student's model family (or one trained with its tokenizer), or "
            f"distil through text instead (SFT on the teacher's answers).{where_set(config, teacher_key, student_key)}"
        )
    check_vocab_fits(model_config, teacher.model, "distill.teacher.model", student_path, student_key)


def _first_difference(student: dict[str, int], teacher: dict[str, int]) -> str:
    sizes = f"{len(student)} tokens for the student, {len(teacher)} for the teacher"
    for token, token_id in sorted(student.items(), key=lambda item: item[1]):
        if teacher.get(token) != token_id:
            found = f"id {teacher[token]}" if token in teacher else "no id"
            return f"{sizes}; token {token!r} has id {token_id} for the student and {found} for the teacher"
    extra = sorted(set(teacher) - set(student), key=teacher.__getitem__)[0]
    return f"{sizes}; token {extra!r} (id {teacher[extra]}) exists for the teacher only"
