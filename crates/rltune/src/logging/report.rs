//! `report.html`: one self-contained page (inline CSS and SVG, no scripts, no external
//! resources) that summarizes a run.
//!
//! Each plot is a `<figure>` with a fixed id (`plot-reward`, `plot-reward-heatmap`, `plot-kl`,
//! `plot-logprobs`, `plot-time`); when its keys were never logged or hold no finite value, the
//! figure holds a note saying so instead of an `<svg>`. The samples table is `#samples`.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use super::jsonl::MetricRow;
use super::plots::{self, hex, Panel, PlotError, Series, PALETTE};
use super::SampleRow;

/// Escapes text for HTML element content and attribute values.
pub fn escape_html(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const CSS: &str = "
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; color: #222; background: #f6f7f9;
       margin: 0; padding: 24px; }
main { max-width: 1000px; margin: 0 auto; }
h1 { font-size: 26px; margin: 0 0 4px; }
h2 { font-size: 19px; margin: 0 0 4px; }
.sub { color: #666; margin: 0 0 16px; }
.summary { display: grid; grid-template-columns: repeat(auto-fill, minmax(180px, 1fr)); gap: 10px; margin: 16px 0; }
.card { background: #fff; border: 1px solid #dde1e6; border-radius: 8px; padding: 10px 14px; }
.card .k { color: #666; font-size: 13px; } .card .v { font-size: 22px; font-weight: 600; }
figure, section { background: #fff; border: 1px solid #dde1e6; border-radius: 8px; margin: 0 0 18px;
                  padding: 14px 16px; }
figcaption p { color: #555; margin: 0 0 8px; font-size: 14px; }
figure svg { display: block; max-width: 100%; height: auto; }
.legend { font-size: 13px; margin-top: 6px; }
.legend span.item { margin-right: 16px; white-space: nowrap; }
.swatch { display: inline-block; width: 14px; height: 4px; vertical-align: middle; margin-right: 5px; }
.note { color: #8a5a00; background: #fff8e6; border-radius: 6px; padding: 8px 12px; }
.warn { color: #8a1c1c; background: #fdecec; border-radius: 6px; padding: 8px 12px; margin: 8px 0; }
code { background: #f0f1f3; padding: 0 3px; border-radius: 3px; }
details { border-top: 1px solid #eee; padding: 6px 0; }
summary { cursor: pointer; font-weight: 600; }
table { border-collapse: collapse; width: 100%; margin-top: 6px; font-size: 13px; table-layout: fixed; }
th, td { border: 1px solid #e3e3e3; padding: 4px 8px; text-align: left; vertical-align: top;
         white-space: pre-wrap; overflow-wrap: anywhere; }
th { background: #f3f4f6; } td.r, th.r { width: 80px; text-align: right; }
";

/// Renders the report page for `rows` (in step order) and the logged `samples`.
pub fn render_report(title: &str, rows: &[MetricRow], samples: &[(usize, Vec<SampleRow>)]) -> String {
    let mut html = String::new();
    html.push_str("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n");
    let _ = writeln!(html, "<title>{}</title>", escape_html(title));
    let _ = writeln!(html, "<style>{CSS}</style>\n</head>\n<body>\n<main>");
    html.push_str(&header(title, rows));
    html.push_str(&reward_figure(rows));
    if rows.iter().any(|r| EPISODE_KEYS.iter().any(|k| r.get(k).is_some())) {
        html.push_str(&episodes_figure(rows));
    }
    // GRPO/RLOO runs log TRL's names: no reward histogram, no rollout logprobs.
    let group = rows.iter().any(|r| GROUP_KEYS.iter().any(|k| r.get(k).is_some()));
    if !group {
        html.push_str(&heatmap_figure(rows));
    }
    html.push_str(&kl_figure(rows));
    if group {
        html.push_str(&group_figure(rows));
    } else {
        html.push_str(&logprobs_figure(rows));
    }
    html.push_str(&time_figure(rows));
    html.push_str(&samples_section(samples));
    html.push_str("</main>\n</body>\n</html>\n");
    html
}

/// The finite-or-NaN `(step, value)` points of `key` over the rows that logged it.
fn points(rows: &[MetricRow], key: &str) -> Vec<(f64, f64)> {
    rows.iter().filter_map(|r| r.scalars.get(key).map(|&v| (r.step as f64, v))).collect()
}

/// The first key of `keys` with a finite value in some row.
fn first_logged<'a>(rows: &[MetricRow], keys: &[&'a str]) -> Option<&'a str> {
    keys.iter().copied().find(|k| rows.iter().any(|r| r.get(k).is_some()))
}

fn last_value(rows: &[MetricRow], key: &str) -> Option<f64> {
    rows.iter().rev().find_map(|r| r.get(key))
}

fn first_value(rows: &[MetricRow], key: &str) -> Option<f64> {
    rows.iter().find_map(|r| r.get(key))
}

/// The mean reward of a batch: PPO's, TRL v0.11's older name, GRPO/RLOO's.
const REWARD_MEAN: [&str; 3] = ["env/reward_mean", "ppo/mean_scores", "reward"];
/// The standard deviations beside each of [`REWARD_MEAN`].
const REWARD_STD: [&str; 3] = ["env/reward_std", "ppo/std_scores", "reward_std"];
/// The KL of PPO (`objective/kl`) and of GRPO/RLOO (`kl`).
const KL: [&str; 2] = ["objective/kl", "kl"];
/// GRPO/RLOO's completion and clipping metrics (TRL's names), drawn in their own figure.
pub const GROUP_KEYS: [&str; 4] =
    ["completions/mean_length", "clip_ratio/region_mean", "frac_reward_zero_std", "entropy"];

fn header(title: &str, rows: &[MetricRow]) -> String {
    let mut h = String::new();
    let _ = writeln!(h, "<header>\n<h1>{}</h1>", escape_html(title));
    let span = match (rows.first(), rows.last()) {
        (Some(a), Some(b)) => format!("steps {}–{}", a.step, b.step),
        _ => "no steps logged yet".into(),
    };
    let _ = writeln!(h, "<p class=\"sub\">Run report · {span}</p>\n<div class=\"summary\">");
    let fmt = |v: Option<f64>| v.map_or("–".to_string(), plots::fmt_num);
    let reward = first_logged(rows, &REWARD_MEAN).unwrap_or(REWARD_MEAN[0]);
    let step_time = rows.iter().filter_map(|r| r.get("time/ppo/total")).collect::<Vec<_>>();
    let cards = [
        ("last step", rows.last().map_or("–".to_string(), |r| r.step.to_string())),
        ("first reward mean", fmt(first_value(rows, reward))),
        ("last reward mean", fmt(last_value(rows, reward))),
        ("final KL", fmt(first_logged(rows, &KL).and_then(|k| last_value(rows, k)))),
        ("final KL coef", fmt(last_value(rows, "objective/kl_coef"))),
        (
            "mean PPO step time (s)",
            fmt(Some(step_time.iter().sum::<f64>() / step_time.len() as f64).filter(|t| t.is_finite())),
        ),
    ];
    for (k, v) in cards {
        let _ = writeln!(h, "<div class=\"card\"><div class=\"k\">{k}</div><div class=\"v\">{v}</div></div>");
    }
    h.push_str("</div>\n");
    // Warnings (text stats), each with the steps that raised it.
    let mut seen: Vec<(String, String, Vec<usize>)> = Vec::new();
    for r in rows {
        for (k, t) in &r.texts {
            match seen.iter_mut().find(|(sk, st, _)| sk == k && st == t) {
                Some(e) => e.2.push(r.step),
                None => seen.push((k.clone(), t.clone(), vec![r.step])),
            }
        }
    }
    for (k, t, steps) in seen {
        let steps: Vec<String> = steps.iter().map(usize::to_string).collect();
        let _ = writeln!(
            h,
            "<p class=\"warn\"><code>{}</code> at step {}: {}</p>",
            escape_html(&k),
            steps.join(", "),
            escape_html(&t)
        );
    }
    h.push_str("</header>\n");
    h
}

/// A `<figure>` with a title, a description, and the plot (or a note saying why there is none).
fn figure(id: &str, title: &str, desc: &str, plot: Result<String, PlotError>, legend: &[Series]) -> String {
    let mut f = format!("<figure id=\"{id}\">\n<figcaption><h2>{title}</h2><p>{desc}</p></figcaption>\n");
    match plot {
        Ok(svg) => {
            f.push_str(&svg);
            if legend.len() > 1 {
                f.push_str("\n<div class=\"legend\">");
                for s in legend {
                    let _ = write!(
                        f,
                        "<span class=\"item\"><span class=\"swatch\" style=\"background:{}\"></span>{}</span>",
                        hex(s.color),
                        escape_html(&s.label)
                    );
                }
                f.push_str("</div>");
            }
        }
        Err(note) => {
            let _ = write!(f, "<p class=\"note\">Not plotted: {}</p>", escape_html(&note.0));
        }
    }
    f.push_str("\n</figure>\n");
    f
}

/// `Err(note)` naming the keys when none of them was logged with a finite value.
fn require(rows: &[MetricRow], keys: &[&str]) -> Result<(), PlotError> {
    if keys.iter().any(|k| rows.iter().any(|r| r.get(k).is_some())) {
        Ok(())
    } else {
        let names: Vec<String> = keys.iter().map(|k| format!("`{k}`")).collect();
        Err(PlotError(format!("no finite values of {} were logged.", names.join(" or "))))
    }
}

fn series(rows: &[MetricRow], key: &str, color: usize) -> Series {
    Series { label: key.to_string(), points: points(rows, key), color: PALETTE[color % PALETTE.len()] }
}

fn reward_figure(rows: &[MetricRow]) -> String {
    let plot = require(rows, &REWARD_MEAN).and_then(|_| {
        let mean_key = first_logged(rows, &REWARD_MEAN).unwrap_or(REWARD_MEAN[0]);
        let std_key = REWARD_STD[REWARD_MEAN.iter().position(|k| *k == mean_key).unwrap_or(0)];
        let band = rows
            .iter()
            .filter_map(|r| {
                let (m, s) = (r.get(mean_key)?, r.get(std_key)?);
                Some((r.step as f64, m - s, m + s))
            })
            .collect();
        let panel = Panel {
            title: String::new(),
            y_desc: "reward".into(),
            series: vec![series(rows, mean_key, 0)],
            band,
            ..Panel::default()
        };
        plots::line_svg(&[panel])
    });
    let desc =
        "Mean reward of each batch (<code>env/reward_mean</code>; GRPO/RLOO: <code>reward</code>), the \
                band ± one standard deviation (<code>env/reward_std</code>; <code>reward_std</code>).";
    figure("plot-reward", "Reward", desc, plot, &[])
}

/// The episode metrics of runs on text games, drawn by the `plot-episodes` figure (only in
/// such runs' reports).
pub const EPISODE_KEYS: [&str; 8] = [
    "env/win_rate",
    "eval/win_rate",
    "env/normalized_score_mean",
    "eval/normalized_score_mean",
    "env/episode_length_mean",
    "eval/episode_length_mean",
    "env/invalid_action_rate",
    "eval/invalid_action_rate",
];

fn episodes_figure(rows: &[MetricRow]) -> String {
    let panels: Vec<Panel> = EPISODE_KEYS
        .chunks(2)
        .enumerate()
        .map(|(i, pair)| Panel {
            title: pair[0].trim_start_matches("env/").replace('_', " "),
            y_desc: if i == 2 { "moves".into() } else { "fraction".into() },
            series: pair
                .iter()
                .enumerate()
                .filter(|(_, k)| rows.iter().any(|r| r.get(k).is_some()))
                .map(|(j, k)| series(rows, k, j))
                .collect(),
            ..Panel::default()
        })
        .filter(|p| !p.series.is_empty())
        .collect();
    let plot = plots::line_svg(&panels).map_err(|e| PlotError(format!("episode metrics: {e}.")));
    let legend = [series(rows, EPISODE_KEYS[0], 0), series(rows, EPISODE_KEYS[1], 1)];
    let desc = "The episodes of each step's rollouts on training games (<code>env/*</code>) and, when \
                evaluated, on held-out games (<code>eval/*</code>): wins, score as a fraction of the \
                maximum, moves per episode, and actions the game did not understand.";
    figure("plot-episodes", "Episodes: wins, score, length, invalid actions", desc, plot, &legend)
}

fn heatmap_figure(rows: &[MetricRow]) -> String {
    let key = "env/reward_dist";
    let dists: Vec<(f64, Vec<f64>)> =
        rows.iter().filter_map(|r| r.arrays.get(key).map(|d| (r.step as f64, d.clone()))).collect();
    let plot = if dists.is_empty() {
        Err(PlotError(format!("`{key}` was not logged.")))
    } else {
        plots::heatmap_svg(&dists, "reward").map_err(|e| PlotError(format!("`{key}`: {e}.")))
    };
    let desc = "How the rewards of each batch are distributed (<code>env/reward_dist</code>): \
                one column per step, color = number of samples in each reward bin.";
    figure("plot-reward-heatmap", "Reward distribution over time", desc, plot, &[])
}

fn kl_figure(rows: &[MetricRow]) -> String {
    let group = first_logged(rows, &KL) == Some(KL[1]);
    let keys: &[&str] = if group { &KL[1..] } else { &["objective/kl", "objective/kl_coef"] };
    let plot = require(rows, keys).and_then(|_| {
        let panels: Vec<Panel> = keys
            .iter()
            .enumerate()
            .filter(|(_, k)| rows.iter().any(|r| r.get(k).is_some()))
            .map(|(i, k)| Panel {
                title: k.to_string(),
                y_desc: if i == 0 { "KL (nats)".into() } else { "β".into() },
                series: vec![series(rows, k, i)],
                ..Panel::default()
            })
            .collect();
        plots::line_svg(&panels)
    });
    let desc = "KL divergence of the policy from the reference over a response (<code>objective/kl</code>, \
                healthy between 0 and 10) and the coefficient of the KL penalty (<code>objective/kl_coef</code>); \
                GRPO/RLOO: the per-token KL (<code>kl</code>, logged when beta > 0).";
    figure("plot-kl", "KL and KL coefficient", desc, plot, &[])
}

/// GRPO/RLOO runs: completion length, clipping, groups without signal, entropy.
fn group_figure(rows: &[MetricRow]) -> String {
    let panels: Vec<Panel> = GROUP_KEYS
        .iter()
        .enumerate()
        .filter(|(_, k)| rows.iter().any(|r| r.get(k).is_some()))
        .map(|(i, k)| Panel {
            title: k.to_string(),
            y_desc: if i == 0 {
                "tokens".into()
            } else if i == 3 {
                "nats".into()
            } else {
                "fraction".into()
            },
            series: vec![series(rows, k, i)],
            ..Panel::default()
        })
        .collect();
    let plot = plots::line_svg(&panels).map_err(|e| PlotError(format!("GRPO/RLOO metrics: {e}.")));
    let desc = "Mean completion length in tokens (<code>completions/mean_length</code>), the fraction of \
                tokens whose ratio was clipped (<code>clip_ratio/region_mean</code>), the fraction of groups \
                whose rewards are all equal and so teach nothing (<code>frac_reward_zero_std</code>), and the \
                policy's mean entropy (<code>entropy</code>).";
    figure("plot-group", "Completions, clipping, groups without signal, entropy", desc, plot, &[])
}

fn logprobs_figure(rows: &[MetricRow]) -> String {
    let keys = ["rltune/logprobs_mean", "rltune/ref_logprobs_mean"];
    let legend: Vec<Series> = keys.iter().enumerate().map(|(i, k)| series(rows, k, i)).collect();
    let plot = require(rows, &keys).and_then(|_| {
        let panel = Panel {
            title: String::new(),
            y_desc: "mean logprob".into(),
            series: legend.clone(),
            ..Panel::default()
        };
        plots::line_svg(&[panel])
    });
    let desc =
        "Mean log-probability of the sampled response tokens under the policy and the reference model; \
                the gap between them is what the KL penalty charges for.";
    figure("plot-logprobs", "Log-probabilities: policy vs reference", desc, plot, &legend)
}

fn time_figure(rows: &[MetricRow]) -> String {
    let keys: BTreeSet<&str> = rows
        .iter()
        .flat_map(|r| r.scalars.keys())
        .map(String::as_str)
        .filter(|k| k.starts_with("time/"))
        .collect();
    let legend: Vec<Series> = keys.iter().enumerate().map(|(i, k)| series(rows, k, i)).collect();
    let plot = if keys.is_empty() {
        Err(PlotError("no `time/*` key was logged.".to_string()))
    } else {
        let panel = Panel { y_desc: "seconds".into(), series: legend.clone(), ..Panel::default() };
        plots::line_svg(&[panel]).map_err(|e| PlotError(format!("`time/*`: {e}.")))
    };
    let desc =
        "Wall-clock seconds per step for each phase (every <code>time/*</code> key; nested phases are \
                included in their parents).";
    figure("plot-time", "Time per phase", desc, plot, &legend)
}

fn samples_section(samples: &[(usize, Vec<SampleRow>)]) -> String {
    let mut s = String::from("<section id=\"samples\">\n<h2>Samples</h2>\n");
    if samples.iter().all(|(_, rows)| rows.is_empty()) {
        s.push_str("<p class=\"note\">No samples were logged.</p>\n</section>\n");
        return s;
    }
    s.push_str("<p class=\"sub\">The first samples of each logged step, newest first.</p>\n");
    let last = samples.len() - 1;
    for (i, (step, rows)) in samples.iter().enumerate().rev() {
        let finite: Vec<f64> = rows.iter().map(|r| r.reward as f64).filter(|r| r.is_finite()).collect();
        let mean = if finite.is_empty() {
            "–".into()
        } else {
            plots::fmt_num(finite.iter().sum::<f64>() / finite.len() as f64)
        };
        let open = if i == last { " open" } else { "" };
        let _ = writeln!(
            s,
            "<details{open}><summary>Step {step} · {} samples · mean reward {mean}</summary>\n<table>\n\
             <thead><tr><th>query</th><th>response</th><th class=\"r\">reward</th></tr></thead>\n<tbody>",
            rows.len()
        );
        for r in rows {
            let reward = if r.reward.is_finite() { plots::fmt_num(r.reward as f64) } else { "NaN".into() };
            let _ = writeln!(
                s,
                "<tr><td>{}</td><td>{}</td><td class=\"r\">{reward}</td></tr>",
                escape_html(&r.query),
                escape_html(&r.response)
            );
        }
        s.push_str("</tbody>\n</table>\n</details>\n");
    }
    s.push_str("</section>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_covers_markup_and_quotes() {
        assert_eq!(
            escape_html("<script>alert('x') & \"y\"</script>"),
            "&lt;script&gt;alert(&#39;x&#39;) &amp; &quot;y&quot;&lt;/script&gt;"
        );
        assert_eq!(escape_html("plain é"), "plain é");
    }

    #[test]
    fn samples_are_escaped_in_the_page() {
        let samples =
            vec![(0, vec![SampleRow { query: "<b>q</b>".into(), response: "a & b".into(), reward: 1.0 }])];
        let html = render_report("run <1>", &[], &samples);
        assert!(html.contains("&lt;b&gt;q&lt;/b&gt;") && html.contains("a &amp; b"));
        assert!(!html.contains("<b>q</b>"));
        assert!(html.contains("<title>run &lt;1&gt;</title>"));
    }

    #[test]
    fn missing_keys_give_notes_not_plots() {
        let rows = vec![MetricRow { step: 0, ..Default::default() }];
        let html = render_report("r", &rows, &[]);
        for id in ["plot-reward", "plot-reward-heatmap", "plot-kl", "plot-logprobs", "plot-time"] {
            let at = html.find(&format!("id=\"{id}\"")).unwrap_or_else(|| panic!("{id}"));
            let fig = &html[at..at + html[at..].find("</figure>").unwrap()];
            assert!(fig.contains("Not plotted") && !fig.contains("<svg"), "{id}: {fig}");
        }
        assert!(html.contains("No samples were logged"));
    }

    #[test]
    fn grpo_runs_plot_trl_names() {
        let rows: Vec<MetricRow> = (1..=3)
            .map(|step| {
                let mut r = MetricRow { step, ..Default::default() };
                for (k, v) in [("reward", 0.1), ("reward_std", 0.3), ("kl", 0.01)] {
                    r.scalars.insert(k.into(), v * step as f64);
                }
                for k in GROUP_KEYS {
                    r.scalars.insert(k.into(), step as f64);
                }
                r
            })
            .collect();
        let html = render_report("r", &rows, &[]);
        for id in ["plot-reward", "plot-kl", "plot-group"] {
            let at = html.find(&format!("id=\"{id}\"")).unwrap_or_else(|| panic!("{id}"));
            let fig = &html[at..at + html[at..].find("</figure>").unwrap()];
            assert!(fig.contains("<svg") && !fig.contains("Not plotted"), "{id}: {fig}");
        }
        assert!(!html.contains("plot-reward-heatmap") && !html.contains("plot-logprobs"));
        assert!(html.contains("completions/mean_length"));
    }
}
