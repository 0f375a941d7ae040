//! The run report opened in a real browser: headless Chromium loads `report.html` from a
//! synthetic 20-step run, and the test checks from the rendered DOM that every plot was drawn,
//! and that a screenshot of the page is not blank.
//!
//! Without a Chromium binary the test prints `SKIPPED` and passes, unless `RLTUNE_REQUIRE_CHROMIUM`
//! is set (CI sets it after `apt-get install -y chromium`). `RLTUNE_CHROMIUM` names the binary to
//! use. The page and the screenshot are left in `target/tmp/report-browser/` for a look.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rltune::engine::{Stat, Stats};
use rltune::logging::{RunLogger, SampleRow};

const STEPS: usize = 20;
const BATCH: usize = 32;
const FIGURES: [&str; 5] = ["plot-reward", "plot-reward-heatmap", "plot-kl", "plot-logprobs", "plot-time"];
const INJECTION: &str = "<script>document.title='pwned'</script><img src=x>";

/// A deterministic stand-in for a normal sample (sum of uniforms from an LCG).
fn noise(state: &mut u64) -> f64 {
    let mut acc = 0.0;
    for _ in 0..6 {
        *state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        acc += (*state >> 11) as f64 / (1u64 << 53) as f64;
    }
    (acc - 3.0) / 0.7
}

/// Stats shaped like the PPO loop's: rewards improving, KL growing, an adaptive KL coefficient.
fn synthetic_stats(step: usize, rng: &mut u64) -> (Stats, Vec<SampleRow>) {
    let t = step as f64 / STEPS as f64;
    let rewards: Vec<f64> = (0..BATCH).map(|_| -0.5 + 2.5 * t + 0.6 * noise(rng)).collect();
    let mean = rewards.iter().sum::<f64>() / BATCH as f64;
    let std = (rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (BATCH - 1) as f64).sqrt();
    let mut s = Stats::new();
    s.insert("env/reward_mean".into(), Stat::Scalar(mean));
    s.insert("env/reward_std".into(), Stat::Scalar(std));
    s.insert("env/reward_dist".into(), Stat::Array(rewards.clone()));
    s.insert("objective/kl".into(), Stat::Scalar(6.0 * t * t + 0.1 * noise(rng).abs()));
    s.insert("objective/kl_coef".into(), Stat::Scalar(0.2 * (1.0 + 0.5 * t)));
    s.insert("objective/logprobs".into(), Stat::Matrix(vec![vec![-1.0; 4]; 2]));
    s.insert("rltune/logprobs_mean".into(), Stat::Scalar(-2.0 + 0.8 * t));
    s.insert("rltune/ref_logprobs_mean".into(), Stat::Scalar(-2.0 - 0.3 * t));
    s.insert("ppo/policy/ratio".into(), Stat::Array(vec![1.0; 64]));
    // A NaN in the middle of a series must be skipped, not break the plot.
    let gen = if step == 7 { f64::NAN } else { 1.2 + 0.1 * noise(rng).abs() };
    for (k, v) in [
        ("time/rollout/generation", gen),
        ("time/rollout/reward", 0.3),
        ("time/ppo/forward_pass", 0.4),
        ("time/ppo/optimize_step", 1.5 + 0.05 * noise(rng)),
        ("time/ppo/total", 2.2),
    ] {
        s.insert(k.into(), Stat::Scalar(v));
    }
    let samples = (0..3)
        .map(|i| SampleRow {
            query: if i == 0 { INJECTION.into() } else { format!("Review {step}.{i}: this movie") },
            response: format!(" was {} & \"fun\"", ["dull", "fine", "great"][i]),
            reward: rewards[i] as f32,
        })
        .collect();
    (s, samples)
}

/// The Chromium binary: `RLTUNE_CHROMIUM`, or the first of the usual names that runs.
fn find_chromium() -> Option<PathBuf> {
    let candidates: Vec<String> = match std::env::var("RLTUNE_CHROMIUM") {
        Ok(c) => vec![c],
        Err(_) => ["chromium", "chromium-browser", "google-chrome"].iter().map(|s| s.to_string()).collect(),
    };
    candidates.into_iter().map(PathBuf::from).find(|c| {
        Command::new(c)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// Runs headless Chromium with `extra` arguments on `page`, killing it after 90 s; returns stdout.
fn chromium(bin: &Path, profile: &Path, extra: &[String], page: &Path) -> String {
    let mut args: Vec<String> = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.push(format!("--user-data-dir={}", profile.display()));
    args.extend(extra.iter().cloned());
    args.push(format!("file://{}", page.display()));
    let out_path = profile.join("stdout.txt");
    let out_file = std::fs::File::create(&out_path).expect("stdout file");
    let mut child = Command::new(bin)
        .args(&args)
        .stdout(out_file)
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        match child.try_wait().expect("waiting for chromium") {
            Some(status) => {
                assert!(status.success(), "chromium {args:?} exited with {status}");
                break;
            }
            None if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("chromium {args:?} did not finish in 90 s");
            }
            None => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    std::fs::read_to_string(&out_path).expect("chromium stdout")
}

/// The markup of `<figure id="id">…</figure>` in `dom`.
fn figure<'a>(dom: &'a str, id: &str) -> &'a str {
    let start =
        dom.find(&format!("<figure id=\"{id}\"")).unwrap_or_else(|| panic!("no figure #{id} in the DOM"));
    let end = dom[start..].find("</figure>").unwrap_or_else(|| panic!("figure #{id} not closed"));
    &dom[start..start + end]
}

fn count(haystack: &str, needle: &str) -> usize {
    haystack.matches(needle).count()
}

fn write_report(out: &Path) -> PathBuf {
    let run = out.join("run");
    let _ = std::fs::remove_dir_all(&run);
    let mut logger = RunLogger::create(&run, None).expect("create run dir");
    let mut rng = 42u64;
    for step in 1..=STEPS {
        let (stats, samples) = synthetic_stats(step, &mut rng);
        logger.log_step(step, &stats, &samples).expect("log step");
    }
    logger.write_report().expect("write report")
}

#[test]
fn report_plots_render_in_headless_chromium() {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("report-browser");
    std::fs::create_dir_all(&out).expect("output dir");
    let page = write_report(&out).canonicalize().expect("report path");
    let Some(bin) = find_chromium() else {
        if std::env::var_os("RLTUNE_REQUIRE_CHROMIUM").is_some() {
            panic!("RLTUNE_REQUIRE_CHROMIUM is set but no chromium was found (apt-get install -y chromium)");
        }
        println!(
            "SKIPPED report_plots_render_in_headless_chromium: no chromium binary (report at {})",
            page.display()
        );
        return;
    };
    let profile = tempfile::tempdir().expect("profile dir");

    let dom = chromium(&bin, profile.path(), &["--dump-dom".to_string()], &page);
    std::fs::write(out.join("dom.html"), &dom).expect("save dom");
    assert!(dom.contains("<title>rltune run: run</title>"), "page title changed (script injection?)");
    assert!(!dom.contains("<img"), "a sample's markup was rendered as HTML");
    assert!(dom.contains("&lt;script&gt;document.title="), "escaped sample text missing");
    for id in FIGURES {
        let fig = figure(&dom, id);
        assert!(fig.contains("<svg"), "#{id} has no <svg>: {}", &fig[..fig.len().min(400)]);
        assert!(!fig.contains("Not plotted"), "#{id}: {fig}");
        let shapes: usize =
            ["<polyline", "<path", "<rect", "<polygon", "<circle"].iter().map(|t| count(fig, t)).sum();
        assert!(shapes >= 20, "#{id} has only {shapes} drawn shapes");
    }
    assert!(count(figure(&dom, "plot-reward"), "<polygon") >= 1, "reward band not drawn");
    assert!(count(figure(&dom, "plot-reward-heatmap"), "<rect") >= 100, "heatmap cells not drawn");
    assert!(count(figure(&dom, "plot-kl"), "<polyline") >= 2, "KL panels not drawn");
    assert!(count(figure(&dom, "plot-logprobs"), "<polyline") >= 2, "logprob lines not drawn");
    // Five time keys, one broken at the NaN of step 7.
    assert!(count(figure(&dom, "plot-time"), "<polyline") >= 6, "time lines not drawn");
    assert_eq!(count(&dom, "<details"), STEPS, "one samples table per step");

    let shot = out.join("shot.png");
    let _ = std::fs::remove_file(&shot);
    let args = [format!("--screenshot={}", shot.display()), "--window-size=1200,3000".to_string()];
    chromium(&bin, profile.path(), &args, &page);
    let png = std::fs::read(&shot).expect("screenshot written");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    assert!(png.len() > 60_000, "screenshot is only {} bytes: blank page?", png.len());
    println!("report: {}\nscreenshot: {}", page.display(), shot.display());
}
