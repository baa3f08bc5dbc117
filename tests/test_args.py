"""The command-line surface is frozen: changing a flag, default or choice must be deliberate
(Megatron-LM launch scripts and the patches depend on it)."""

from __future__ import annotations

import argparse

import pytest

from megatron_lossfix import LossFixConfig
from megatron_lossfix.args import add_lossfix_args, from_args
from megatron_lossfix.runtime.modes import mode_of
from megatron_lossfix.runtime.weights import ALIASES, MODES

pytestmark = pytest.mark.unit

FROZEN = {
    # flag: (dest, default, choices, nargs-or-type)
    "--loss-reduction": ("loss_reduction", None, (*MODES, "prompt_mean"), "str"),
    "--loss-norm-constant": ("loss_norm_constant", None, None, "float"),
    "--lossfix-check-finite": ("lossfix_check_finite", False, None, "store_true"),
    "--lossfix-no-validate": ("lossfix_no_validate", False, None, "store_true"),
    "--lossfix-mask-in-loss": ("lossfix_mask_in_loss", False, None, "store_true"),
    "--lossfix-counting-pass": ("lossfix_counting_pass", False, None, "store_true"),
    # None: on with --loss-reduction (the first step is checked), --no-lossfix-self-check: off.
    "--lossfix-self-check": ("lossfix_self_check", None, None, "[no-]flag"),
    # A finite number > 0, checked by the parser so that its error names the flag.
    "--lossfix-self-check-tolerance": (
        "lossfix_self_check_tolerance",
        1e-5,
        None,
        "positive_float",
    ),
}


def _group_actions(**kwargs) -> list[argparse.Action]:
    parser = add_lossfix_args(argparse.ArgumentParser(), **kwargs)
    groups = [g for g in parser._action_groups if g.title == "megatron_lossfix"]
    assert len(groups) == 1, "all flags live in one 'megatron_lossfix' group"
    return groups[0]._group_actions


def _kind(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "store_true"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "[no-]flag"
    return getattr(action.type, "__name__", "str") if action.type else "str"


def test_flag_surface_is_frozen():
    actions = _group_actions()
    got = {a.option_strings[0]: (a.dest, a.default, a.choices and tuple(a.choices), _kind(a))
           for a in actions}  # fmt: skip
    assert got == FROZEN


def test_megatron_lm_adds_only_its_metrics_file():
    actions = _group_actions(megatron_lm=True)
    extra = {a.option_strings[0] for a in actions} - FROZEN.keys()
    assert extra == {"--lossfix-metrics-out"}


def test_every_flag_has_help():
    for action in _group_actions(megatron_lm=True):
        assert action.help and len(action.help) > 20, action.option_strings


def test_flags_absent_mean_plugin_absent():
    args = add_lossfix_args(argparse.ArgumentParser()).parse_args([])
    assert from_args(args) is None


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_round_trips(mode):
    argv = ["--loss-reduction", mode]
    if mode_of(mode).uses_constant:
        argv += ["--loss-norm-constant", "512"]
    config = from_args(add_lossfix_args(argparse.ArgumentParser()).parse_args(argv))
    assert isinstance(config, LossFixConfig) and config.reduction == mode
    assert config.norm_constant == (512 if mode_of(mode).uses_constant else None)


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_an_alias_gives_the_config_of_its_mode(alias):
    config = from_args(
        add_lossfix_args(argparse.ArgumentParser()).parse_args(["--loss-reduction", alias])
    )
    assert config.reduction == ALIASES[alias] == LossFixConfig(reduction=alias).reduction


def test_debug_flags_reach_the_config():
    argv = ["--loss-reduction", "sum", "--lossfix-check-finite", "--lossfix-no-validate"]
    config = from_args(add_lossfix_args(argparse.ArgumentParser()).parse_args(argv))
    assert config.check_finite and not config.validate


def test_unknown_mode_is_refused_by_the_parser():
    with pytest.raises(SystemExit):
        add_lossfix_args(argparse.ArgumentParser()).parse_args(["--loss-reduction", "mean"])


def _schedule(argv):
    from megatron_lossfix.args import schedule_from_args

    return schedule_from_args(add_lossfix_args(argparse.ArgumentParser()).parse_args(argv))


def test_schedule_from_args_without_the_flag_is_stock():
    """The own-loop recipe works without --loss-reduction: mode off (stock Megatron), where
    LossFixSchedule(from_args(args)) would get None."""
    from megatron_lossfix import LossFixSchedule

    schedule = _schedule([])
    assert isinstance(schedule, LossFixSchedule) and schedule.config.reduction == "off"


def test_schedule_from_args_takes_the_mode_and_the_self_check():
    from megatron_lossfix import LossFixSchedule
    from megatron_lossfix.step.selfcheck import SelfCheck

    plain = _schedule(["--loss-reduction", "sequence_mean", "--lossfix-no-validate"])
    assert isinstance(plain, LossFixSchedule)
    assert plain.config.reduction == "sequence_mean" and not plain.config.validate
    flags = ["--loss-reduction", "sum", "--lossfix-self-check"]
    checked = _schedule([*flags, "--lossfix-self-check-tolerance", "0.01"])
    assert isinstance(checked, LossFixSchedule) and checked.config.reduction == "sum"
    assert isinstance(checked.self_check, SelfCheck) and checked.self_check.tolerance == 0.01
    assert isinstance(plain.self_check, SelfCheck) and not plain.self_check.explicit  # default
    assert checked.self_check.explicit
    opted_out = _schedule(["--loss-reduction", "sum", "--no-lossfix-self-check"])
    assert opted_out.config.self_check is False and opted_out.self_check is None
    assert _schedule([]).self_check is None  # off: stock, nothing to check
    with pytest.raises(ValueError, match="needs --loss-reduction"):
        _schedule(["--lossfix-self-check"])
    with pytest.raises(ValueError, match="--loss-norm-constant"):
        _schedule(["--loss-reduction", "token_mean", "--loss-norm-constant", "4"])


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--loss-norm-constant", "4"], "needs --loss-reduction seq_mean_token_sum_norm"),
        (["--loss-reduction", "sum", "--loss-norm-constant", "4"], "applies only to"),
        (["--loss-reduction", "seq_mean_token_sum_norm"], "needs norm_constant"),
        (["--loss-reduction", "seq_mean_token_sum_norm", "--loss-norm-constant", "0"], "> 0"),
    ],
)
def test_flag_combinations_are_refused(argv, match):
    args = add_lossfix_args(argparse.ArgumentParser()).parse_args(argv)
    with pytest.raises(ValueError, match=match):
        from_args(args)


def test_masks_decided_in_the_loss_flags():
    parser = add_lossfix_args(argparse.ArgumentParser())
    mode = ["--loss-reduction", "sequence_mean"]
    config = from_args(parser.parse_args([*mode, "--lossfix-mask-in-loss"]))
    assert config.mask_in_loss and not config.counting_pass
    both = ["--lossfix-mask-in-loss", "--lossfix-counting-pass"]
    config = from_args(parser.parse_args([*mode, *both]))
    assert config.mask_in_loss and config.counting_pass
    with pytest.raises(ValueError, match="--lossfix-counting-pass.*--lossfix-mask-in-loss"):
        from_args(parser.parse_args([*mode, "--lossfix-counting-pass"]))
    for flag in both:
        with pytest.raises(ValueError, match=f"{flag} needs --loss-reduction"):
            from_args(parser.parse_args([flag]))
    with pytest.raises(ValueError, match="--lossfix-mask-in-loss.*plugin mode"):
        from_args(parser.parse_args(["--loss-reduction", "off", "--lossfix-mask-in-loss"]))
