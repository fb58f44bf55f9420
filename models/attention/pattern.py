"""Which attention each block of a staged backbone gets, from a name, a list or an official pattern string."""
from typing import Any, List, Optional, Sequence, Union

from .registry import UnknownAttentionError, close_attention_name, get_mixer_class, list_attentions

__all__ = ['PATTERN_LETTERS', 'stage_attentions']

# Letters of the official InLine / FLatten `attn_type` strings.
PATTERN_LETTERS = {'I': 'inline', 'L': 'flatten', 'S': 'softmax'}


def _pattern_error(attn_type: Any, num_stages: int, why: str, unknown: bool = False) -> ValueError:
    """The refusal of `attn_type`; an `UnknownAttentionError` where it may be a name not registered yet."""
    plural = '' if num_stages == 1 else 's'
    close = close_attention_name(attn_type) if unknown else ''
    message = (
        f"bad attn_type {attn_type!r} ({why}{f'; {close}' if close else ''}); expected an "
        f"attention name ({', '.join(list_attentions())}), a list of {num_stages} name{plural}, or a pattern of "
        f"{num_stages} letter{plural} from I (inline), L (flatten), S (softmax), M (mixed) with the number of linear "
        f"blocks of the M stage appended, e.g. 'IIMS2'")
    return UnknownAttentionError(message, attn_type) if unknown else ValueError(message)


def stage_attentions(
        attn_type: Union[str, Sequence[str]],
        depths: Sequence[int],
        mixed_linear: Optional[str] = None,
) -> List[List[str]]:
    """Per stage, the attention name of every block.

    `attn_type` is one registered name for every block, a list with one name per stage, or a pattern string with
    one letter per stage: 'I' InLine, 'L' FLatten, 'S' softmax, and 'M' for a stage whose first m blocks use the
    pattern's linear attention (its I or L, else `mixed_linear`, a name or letter, by default InLine) and the rest
    softmax, m being the number after the letters ('IIMS2': stage 3 has 2 InLine blocks, then softmax).
    """
    num_stages = len(depths)
    if isinstance(attn_type, str):
        if attn_type in list_attentions():
            return [[attn_type] * d for d in depths]
        letters, suffix = attn_type[:num_stages], attn_type[num_stages:]
        if len(letters) < num_stages or any(c not in 'ILSM' for c in letters):
            raise _pattern_error(attn_type, num_stages, 'not a name or pattern', unknown=True)
        if 'M' in letters and not suffix.isdigit():
            raise _pattern_error(attn_type, num_stages, "an M stage needs its number of linear blocks")
        if 'M' not in letters and suffix:
            raise _pattern_error(attn_type, num_stages, f"unexpected {suffix!r} after the stage letters")
        linear = [PATTERN_LETTERS[c] for c in letters if c in 'IL']
        if len(set(linear)) > 1 and 'M' in letters:
            raise _pattern_error(attn_type, num_stages, 'an M stage is ambiguous with both I and L stages')
        mixed = linear[0] if linear else PATTERN_LETTERS.get(mixed_linear or 'I', mixed_linear)
        mixed_depths = [depth for letter, depth in zip(letters, depths) if letter == 'M']
        if mixed_depths and int(suffix) > min(mixed_depths):
            raise _pattern_error(attn_type, num_stages, f"{int(suffix)} linear blocks in an M stage of "
                                                        f"{min(mixed_depths)} blocks")
        stages = []
        for letter, depth in zip(letters, depths):
            if letter == 'M':
                m = int(suffix)
                stages.append([mixed] * min(m, depth) + ['softmax'] * max(depth - m, 0))
            else:
                stages.append([PATTERN_LETTERS[letter]] * depth)
        return stages
    if not isinstance(attn_type, (list, tuple)):
        raise _pattern_error(attn_type, num_stages, 'neither a name, a list nor a pattern')
    names = list(attn_type)
    if len(names) != num_stages:
        raise _pattern_error(str(names), num_stages, f'{len(names)} names for {num_stages} stages')
    for name in names:
        get_mixer_class(name)
    return [[name] * d for name, d in zip(names, depths)]
