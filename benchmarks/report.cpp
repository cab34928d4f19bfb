#include <fmt/format.h>
#include <sys/utsname.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "scaletrain/bench.h"
#include "scaletrain/error.h"

namespace scaletrain::bench {
namespace {

namespace fs = std::filesystem;

std::string today() {
  std::time_t t = std::time(nullptr);
  char buf[16];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d", std::gmtime(&t));
  return buf;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  utsname u{};
  uname(&u);
  return u.machine;
}

// gnuplot data: one block per series, "x_label x_value mean std".
std::vector<std::string> series_in_order(const SuiteResult& r) {
  std::vector<std::string> names;
  for (auto& s : r.samples) {
    if (std::find(names.begin(), names.end(), s.series) == names.end()) names.push_back(s.series);
  }
  return names;
}

std::string quote(const std::string& s) {
  std::string q;
  for (char c : s) q += c == '"' ? std::string("\\\"") : std::string(1, c);
  return "\"" + q + "\"";
}

}  // namespace

Stats stats(const std::vector<double>& v) {
  Stats s;
  s.n = v.size();
  if (v.empty()) return s;
  s.min = s.max = v[0];
  for (double x : v) {
    s.mean += x;
    s.min = std::min(s.min, x);
    s.max = std::max(s.max, x);
  }
  s.mean /= static_cast<double>(v.size());
  for (double x : v) s.std += (x - s.mean) * (x - s.mean);
  s.std = std::sqrt(s.std / static_cast<double>(v.size()));
  return s;
}

Machine describe_machine(const std::string& gpu, const std::string& libtorch) {
  Machine m;
  m.cpu = cpu_model();
  m.cores = static_cast<int>(std::thread::hardware_concurrency());
  m.gpu = gpu.empty() ? "none" : gpu;
  m.libtorch = libtorch;
  m.date = today();
  return m;
}

namespace {

bool on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::string dirs = path != nullptr ? path : "";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    std::string dir = dirs.substr(start, end - start);
    if (!dir.empty() && access((dir + "/" + program).c_str(), X_OK) == 0) return true;
    start = end + 1;
  }
  return false;
}

void write_plot_data(const SuiteResult& r, const std::vector<std::string>& names,
                     const std::string& data_path) {
  std::ofstream d(data_path);
  for (auto& name : names) {
    d << "# " << name << "\n";
    int i = 0;
    for (auto& s : r.samples) {
      if (s.series != name) continue;
      Stats st = stats(s.values);
      d << quote(s.x) << " " << (r.plot.kind == Plot::Kind::kBars ? i : s.x_value) << " " << st.mean
        << " " << st.std << "\n";
      ++i;
    }
    d << "\n\n";
  }
}

// The `plot` command's list: one plot per series, from the data file's block of its index.
std::string series_plots(const SuiteResult& r, const std::vector<std::string>& names,
                         const std::string& data_name) {
  std::string plots;
  const size_t k = names.size();
  for (size_t i = 0; i < k; ++i) {
    if (!plots.empty()) plots += ", ";
    if (r.plot.kind == Plot::Kind::kBars) {
      // Bars of series i sit beside each other around the integer x of their label.
      double width = 0.8 / static_cast<double>(k);
      double shift = (static_cast<double>(i) - (static_cast<double>(k) - 1) / 2) * width;
      plots += fmt::format(
          "'{}' index {} using ($2+{}):3:({}) with boxes title {}, '' index {} using ($2+{}):3:4 "
          "with yerrorbars lc rgb 'black' pt 0 notitle",
          data_name, i, shift, width, quote(names[i]), i, shift);
    } else {
      plots += fmt::format("'{}' index {} using 2:3:4 with yerrorlines title {}", data_name, i,
                           quote(names[i]));
    }
  }
  return plots;
}

// A bar chart's boxes and x tick labels.
std::string bar_settings(const SuiteResult& r, const std::vector<std::string>& names) {
  std::string script = "set style fill solid 0.6 border -1\nset boxwidth 0.8 relative\n";
  // x tick labels from the first series' labels.
  std::string tics;
  int i = 0;
  for (auto& s : r.samples) {
    if (s.series != names.front()) continue;
    tics += fmt::format("{}{} {}", tics.empty() ? "" : ", ", quote(s.x), i++);
  }
  return script + "set xtics (" + tics + ")\nset xrange [-0.6:" + std::to_string(i - 0.4) + "]\n";
}

// Without gnuplot: the script beside the data, and a line saying how to draw it elsewhere.
void leave_script(const std::string& script, const std::string& png_path) {
  const std::string gp_path = fs::path(png_path).replace_extension(".gp").string();
  std::ofstream(gp_path) << script;
  std::fprintf(stderr,
               "scaletrain bench: gnuplot is not installed, so %s was not drawn; its script and "
               "data are in %s; draw it with: cd %s && gnuplot %s\n",
               png_path.c_str(), gp_path.c_str(),
               fs::path(png_path).parent_path().empty()
                   ? "."
                   : fs::path(png_path).parent_path().string().c_str(),
               fs::path(gp_path).filename().string().c_str());
}

}  // namespace

void plot_png(const SuiteResult& r, const std::string& png_path) {
  const std::string data_path = png_path + ".dat";
  // Without gnuplot (a GPU node with no package manager, say) the script and its data stay beside
  // the would-be PNG, named relative to that folder, to be drawn on another machine.
  const bool drawable = on_path("gnuplot");
  const std::string png_name = drawable ? png_path : fs::path(png_path).filename().string();
  const std::string data_name = drawable ? data_path : png_name + ".dat";
  auto names = series_in_order(r);
  write_plot_data(r, names, data_path);
  std::string script = fmt::format(
      "set terminal pngcairo size 900,560 noenhanced font 'sans,10'\n"
      "set output {}\nset title {}\nset xlabel {}\nset ylabel {}\n"
      "set grid ytics\nset key top left\nset yrange [0:*]\n",
      quote(png_name), quote(r.plot.title), quote(r.plot.xlabel), quote(r.plot.ylabel));
  if (r.plot.logx) {
    script += "set logscale x 2\n";
    // Byte counts read best as 4KB, 16MB...
    if (r.plot.xlabel.find("bytes") != std::string::npos) script += "set format x \"%.0s%cB\"\n";
  }
  bool negative = false;
  for (auto& smp : r.samples) negative |= stats(smp.values).mean - stats(smp.values).std < 0;
  if (negative) script += "set yrange [*:*]\n";
  if (r.plot.logy) script += "set logscale y\nset yrange [*:*]\n";
  std::string plots = series_plots(r, names, data_name);
  if (r.plot.kind == Plot::Kind::kBars) script += bar_settings(r, names);
  script += "plot " + plots + "\n";
  if (!drawable) {
    leave_script(script, png_path);
    return;
  }
  FILE* gp = popen("gnuplot 2>&1", "w");
  if (gp == nullptr) throw Error("cannot start gnuplot; install Debian's gnuplot-nox");
  fwrite(script.data(), 1, script.size(), gp);
  int status = pclose(gp);
  fs::remove(data_path);
  std::error_code ec;
  if (status != 0 || !fs::exists(png_path, ec) || fs::file_size(png_path, ec) == 0) {
    throw Error("gnuplot failed to draw " + png_path + " (is Debian's gnuplot-nox installed?)");
  }
}

std::string write_suite(const SuiteResult& r, const Machine& m, const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error("cannot create the output folder '" + dir + "': " + ec.message());
  const std::string base = dir + "/" + r.suite;
  {
    std::ofstream csv(base + ".csv");
    if (!csv) throw Error("cannot write " + base + ".csv");
    csv << "series,x,repetition,value_" << r.unit << "\n";
    for (auto& s : r.samples) {
      for (size_t i = 0; i < s.values.size(); ++i) {
        csv << s.series << "," << s.x << "," << i << "," << fmt::format("{:.9g}", s.values[i])
            << "\n";
      }
    }
  }
  nlohmann::json j;
  j["suite"] = r.suite;
  j["command"] = r.command;
  j["unit"] = r.unit;
  j["machine"] = {{"cpu", m.cpu},
                  {"cores", m.cores},
                  {"gpu", m.gpu},
                  {"libtorch", m.libtorch},
                  {"date", m.date}};
  for (auto& s : r.samples) {
    Stats st = stats(s.values);
    j["samples"].push_back({{"series", s.series},
                            {"x", s.x},
                            {"mean", st.mean},
                            {"std", st.std},
                            {"min", st.min},
                            {"max", st.max},
                            {"n", st.n},
                            {"values", s.values}});
  }
  std::ofstream(base + ".json") << j.dump(2) << "\n";
  plot_png(r, base + ".png");

  std::string md = fmt::format("## {}\n\n`{}`\n\n{} · {} cores · GPU: {} · LibTorch {} · {}\n\n",
                               r.title, r.command, m.cpu, m.cores, m.gpu, m.libtorch, m.date);
  md += fmt::format(
      "| series | x | mean ({0}) | std ({0}) | min ({0}) | n |\n|---|---|---|---|---|---|\n",
      r.unit);
  for (auto& s : r.samples) {
    Stats st = stats(s.values);
    md += fmt::format("| {} | {} | {:.4g} | {:.2g} | {:.4g} | {} |\n", s.series, s.x, st.mean,
                      st.std, st.min, st.n);
  }
  for (auto& n : r.notes) md += "\n" + n + "\n";
  md += fmt::format("\n![{}]({}.png)\n\n", r.title, r.suite);
  std::ofstream(dir + "/report.md", std::ios::app) << md;
  return md;
}

}  // namespace scaletrain::bench
